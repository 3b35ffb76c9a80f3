//! The `poolipc` command: `demo` (a parent and a worker handing tensors both ways), `doctor`
//! (what this machine can do), `check` (a program on the simulated GPU under many seeds), and
//! the hidden child roles they spawn.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod check;
mod demo;
mod doctor;
mod echo;
mod mps;
mod plot;
mod probe;

/// Zero-copy handoff of GPU tensors between processes under the stream-ordered allocator.
#[derive(Debug, Parser)]
#[command(name = "poolipc", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A parent and a worker process handing tensors both ways, verified and timed: on the
    /// GPU when there is one, else on the simulated driver (saying which).
    Demo(demo::Args),
    /// The handoff's round trip at several sizes and a batch of small tensors, against the
    /// host copy it replaces, measured in the same run.
    Bench(Box<bench::Args>),
    /// Print what this machine can do (driver, pool swap, export order, events, VMM, WSL2)
    /// and a verdict.
    Doctor(doctor::Args),
    /// Run a program on the simulated GPU under many seeds (POOLIPC_SIM_SEED=0, 1, …), its
    /// race checker strict, and stop at the first seed that fails, printing how to replay it.
    Check(check::Args),
    /// Run a command, and every process it starts, as clients of a private CUDA MPS daemon
    /// (handoffs without the GPU's turn-taking; a GPU fault in any client ends all of them:
    /// for trusted workers only).
    Mps(mps::Args),
    /// (internal) The sacrificial child of `doctor --probe-limit`.
    #[command(name = "__import-child", hide = true)]
    ImportChild,
    /// (internal) The worker process of `demo`.
    #[command(name = "__demo-worker", hide = true)]
    DemoWorker,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: a log redirected to a file stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor(args) => doctor::run(&args),
        Command::Mps(args) => mps::run(&args),
        Command::Check(args) => check::run(&args),
        Command::ImportChild => probe::child_main(),
        Command::Demo(args) => demo::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::DemoWorker => demo::worker_main(),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("poolipc: {e:#}");
            ExitCode::FAILURE
        }
    }
}
