# Shared by up.sh, down.sh and leakcheck.sh (sourced).

# running PID: exists and is not a zombie.
running() { [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }

# PIDs whose mount or network namespace is the run's (its daemons, containerd shims).
ns_pids() { # run_dir
  local mnt net p
  mnt=$(cat "$1/mntns" 2>/dev/null) || return 0
  net=$(cat "$1/netns" 2>/dev/null) || return 0
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/mnt" 2>/dev/null)" = "$mnt" ] || [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$net" ] || continue
    echo "${p#/proc/}"
  done
}

# Cgroup directories the kubelet and containerd make (cgroupfs driver, every hierarchy).
node_cgroups() { find /sys/fs/cgroup -mindepth 1 -maxdepth 2 -type d \( -name kubepods -o -name k8s.io \) 2>/dev/null; }

# PIDs in those cgroups: the pods' processes, whatever namespaces they are in.
cgroup_pids() { local d; for d in $(node_cgroups); do find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null; done | sort -un; }
