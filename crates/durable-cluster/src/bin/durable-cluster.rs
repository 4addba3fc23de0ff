//! The `durable-cluster` binary: `durable-cluster admin …`, the operator's view and fixes on
//! the command line (see `durable_cluster::admin::cli`).

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    durable_cluster::admin::cli::run(std::env::args_os()).await
}
