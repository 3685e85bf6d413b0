use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // One TLS crypto provider for the Kubernetes client, whatever features other crates enable.
    let _ = rustls::crypto::ring::default_provider().install_default();
    tollgate_controller::runtime::run(tollgate_controller::args::Args::parse()).await
}
