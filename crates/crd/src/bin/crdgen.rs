//! Prints the RateLimitPolicy CRD as YAML: `cargo run -p tollgate-crd --bin crdgen > manifests/crds/tollgate.dev_ratelimitpolicies.yaml`.

fn main() -> std::process::ExitCode {
    match tollgate_crd::crd_yaml() {
        Ok(yaml) => {
            print!("{yaml}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("crdgen: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
