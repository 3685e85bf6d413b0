//! The command line, kubectl-style: `-n/--namespace`, `-A/--all-namespaces`, `-o`, `--kubeconfig`,
//! `--context`, `--request-timeout`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "kubectl-tollgate",
    bin_name = "kubectl tollgate",
    version,
    about = "Inspect tollgate rate limiting: policy status, the keys limited most, offline policy \
             checks, and why one request is limited in one pod",
    after_help = "Exit codes: 0 success, 1 error (message on stderr), 2 usage error."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Connection options, as kubectl names them.
#[derive(Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Path to the kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else the
    /// in-cluster service account).
    #[arg(long, global = true, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: its current context).
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// The namespace (default: the context's namespace, else `default`).
    #[arg(short = 'n', long, global = true, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// Give up after this long, e.g. `10s` (0 waits forever).
    #[arg(long, global = true, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub request_timeout: Option<Duration>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Policies, their Accepted/Programmed conditions and how many sidecars enforce them.
    #[command(long_about = STATUS_ABOUT)]
    Status(StatusArgs),
    /// The keys a policy rejected most across every sidecar (status.topLimitedKeys).
    #[command(long_about = TOP_ABOUT)]
    Top(TopArgs),
    /// Validate policy files offline and print what each rule will do, exactly as
    /// `tollgate-sidecar check` does; exits 1 on errors, naming each field.
    Check {
        /// Policy files or directories (YAML, multi-document allowed).
        #[arg(required = true, value_name = "FILE")]
        paths: Vec<PathBuf>,
    },
    /// Which rules one request meets in one pod, and the current state of its key there.
    #[command(long_about = WHY_ABOUT)]
    Why(WhyArgs),
}

const STATUS_ABOUT: &str = "\
Policies, their Accepted/Programmed conditions and how many sidecars enforce them.

Columns: ACCEPTED (the policy compiled; see -o wide for the reason), PROGRAMMED (every connected
selected sidecar runs the current rules), SIDECARS (sidecars in sync / connected sidecars the
policy selects), NO-SIDECAR (status.podsWithoutSidecar: pods the policy selects that run without
the sidecar, so their traffic is not limited; see -o wide for the pods), RULES-VERSION (the compiled rule set last streamed to sidecars), GENERATION
(status.observedGeneration / metadata.generation: behind while the controller has not yet
processed the latest edit), PROPAGATION (status.propagation: how long the last accepted
generation took from the controller compiling it to the last selected sidecar's ack),
PROGRAMMED-SINCE (time since the Programmed condition last changed status), AGE.

The fleet's lag distribution is the controller's metric tollgate_controller_stream_lag_seconds.";

const TOP_ABOUT: &str = "\
The keys a policy rejected most across every sidecar, from status.topLimitedKeys, which the
controller merges from the sidecars' reports. Keys appear as their stable identity (KEY-HASH),
never raw: `tollgate-sidecar key-hash` computes the identity of a known key, and the sidecars'
audit lines carry the same key_hash. REJECTED may over-count by up to MAX-OVERCOUNT (the
sketches are approximate).";

const WHY_ABOUT: &str = "\
Which rules one request meets in one pod, and the current state of its key there: remaining
tokens, the lease of a Global rule, a blockFor block. Asks the pod's tollgate sidecar
(GET /debug/why on its admin port, answered to loopback clients only) through the API server's
port-forward, which connects inside the pod's network namespace; nothing is charged. Needs
permission to create pods/portforward. Keys appear as their stable identity, never raw.

Example:
  kubectl tollgate why -n shop --pod shop-api-7d9c-x2 --path /orders --header x-api-key=abc";

/// `-o`: the table unless given.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Json,
    Yaml,
    /// The table with more columns.
    Wide,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// One policy; all in the namespace if omitted.
    #[arg(value_name = "POLICY")]
    pub name: Option<String>,
    /// Policies of every namespace.
    #[arg(short = 'A', long, conflicts_with = "name")]
    pub all_namespaces: bool,
    /// Output format: json, yaml or wide (default: a table).
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Output>,
    /// Do not print the table's header.
    #[arg(long)]
    pub no_headers: bool,
}

#[derive(Args, Debug)]
pub struct TopArgs {
    /// The RateLimitPolicy.
    #[arg(value_name = "POLICY")]
    pub policy: String,
    /// Output format: json, yaml or wide (default: a table).
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Output>,
    /// Do not print the summary line and the table's header.
    #[arg(long)]
    pub no_headers: bool,
}

#[derive(Args, Debug)]
pub struct WhyArgs {
    /// The pod whose sidecar is asked.
    #[arg(long, value_name = "POD")]
    pub pod: String,
    /// The sidecar container (default: the one named tollgate-sidecar).
    #[arg(short = 'c', long, value_name = "CONTAINER")]
    pub container: Option<String>,
    /// The request's method.
    #[arg(long, default_value = "GET")]
    pub method: String,
    /// The request's path, with a query string if it matters (`/search?q=x`).
    #[arg(long, default_value = "/")]
    pub path: String,
    /// A request header, `name=value` (or `name:value`); repeatable.
    #[arg(long = "header", short = 'H', value_name = "NAME=VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// The client address the sidecar would see (clientIP keys, bypass networks); default
    /// 127.0.0.1.
    #[arg(long, value_name = "IP")]
    pub client_ip: Option<std::net::IpAddr>,
    /// Where Global rules' balances are read: `local` (this sidecar's lease only; a key without
    /// one reads "unknown") or `redis` (one read-only Redis call per Global rule).
    #[arg(long, value_enum, default_value = "local")]
    pub balance: Balance,
    /// Output format: json, yaml or wide (default: a table).
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Output>,
}

/// `why --balance`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balance {
    Local,
    Redis,
}

/// The policy's duration grammar (one grammar for every tollgate duration), plus kubectl's bare
/// `0` for "no timeout".
fn parse_duration(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    tollgate_crd::duration::parse_flag(s)
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let at = s
        .find(['=', ':'])
        .ok_or_else(|| format!("{s:?}: expected NAME=VALUE"))?;
    let (name, value) = (s[..at].trim(), s[at + 1..].trim());
    if name.is_empty() {
        return Err(format!("{s:?}: the header name is empty"));
    }
    Ok((name.to_string(), value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn headers_split_at_the_first_equals_or_colon() {
        assert_eq!(
            parse_header("x-api-key=a=b").unwrap(),
            ("x-api-key".into(), "a=b".into())
        );
        assert_eq!(
            parse_header("Authorization: Bearer x:y").unwrap(),
            ("Authorization".into(), "Bearer x:y".into())
        );
        assert!(parse_header("novalue").is_err());
        assert!(parse_header("=v").is_err());
    }
}
