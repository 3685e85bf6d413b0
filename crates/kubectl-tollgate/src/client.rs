//! The Kubernetes client, configured as kubectl would be from `--kubeconfig` and `--context`.

use anyhow::Context as _;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::cli::GlobalArgs;

pub struct Kube {
    pub client: kube::Client,
    /// `-n`, else the context's namespace, else `default`.
    pub namespace: String,
}

pub async fn connect(args: &GlobalArgs) -> anyhow::Result<Kube> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &options)
                .await
                .with_context(|| format!("loading --kubeconfig {}", path.display()))?
        }
        None if args.context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .context("loading the kubeconfig ($KUBECONFIG or ~/.kube/config)")?,
        None => kube::Config::infer().await.context(
            "no cluster configuration: set --kubeconfig or $KUBECONFIG, or run in a pod",
        )?,
    };
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config).context("building the Kubernetes client")?;
    Ok(Kube { client, namespace })
}

/// An API error in kubectl's words: what was not found, or what the server said.
pub fn describe(error: kube::Error, what: &str) -> anyhow::Error {
    match &error {
        kube::Error::Api(status) if status.code == 404 => {
            anyhow::anyhow!("{what} not found")
        }
        kube::Error::Api(status) if status.code == 403 => {
            anyhow::anyhow!("forbidden: {}", status.message)
        }
        _ => anyhow::Error::new(error).context(format!("reading {what}")),
    }
}
