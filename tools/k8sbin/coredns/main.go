// Builder for a CoreDNS with only the plugins a test cluster's DNS needs (the kubernetes
// plugin answers Service and Pod names; bind, health, readiness, caching and logs).
// Importing fewer plugins than upstream's zplugin.go keeps the build small and quick; the
// plugins themselves are upstream's, unchanged.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}
