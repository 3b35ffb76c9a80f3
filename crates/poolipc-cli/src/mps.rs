//! `poolipc mps -- CMD`: runs a command (and every process it starts) as clients of a private
//! CUDA MPS daemon, started before and stopped after. See `poolipc::mps` for what MPS gives
//! (handoffs without the GPU's turn-taking) and what it costs (a GPU fault in one client ends
//! every client's context).

use std::ffi::OsString;
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result};
use poolipc::mps::{MpsOptions, PrivateMps};

/// Options of `poolipc mps`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Accept that under MPS a GPU fault in any client (a worker's kernel) ends the CUDA
    /// context of every client; required.
    #[arg(long)]
    accept_shared_gpu_faults: bool,
    /// The MPS control program (default: nvidia-cuda-mps-control on PATH, or
    /// POOLIPC_MPS_CONTROL).
    #[arg(long)]
    control: Option<std::path::PathBuf>,
    /// How long to wait, after the command, for the daemon to quit (seconds).
    #[arg(long, default_value_t = 30)]
    stop_timeout: u64,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    command: Vec<OsString>,
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let mps = PrivateMps::start(&MpsOptions {
        accept_shared_gpu_faults: args.accept_shared_gpu_faults,
        control_binary: args.control.clone(),
        ..MpsOptions::default()
    })?;
    eprintln!(
        "poolipc mps: private MPS daemon at {}; running {:?} as its client",
        mps.pipe_directory().display(),
        args.command
    );
    let (program, rest) = args.command.split_first().context("no command to run")?;
    let status = Command::new(program)
        .args(rest)
        .envs(mps.env())
        .status()
        .with_context(|| format!("running {}", program.to_string_lossy()))?;
    if !mps.shutdown(Duration::from_secs(args.stop_timeout)) {
        eprintln!("poolipc mps: the daemon has not quit yet; it will once its clients exit");
    }
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => {
            eprintln!("poolipc mps: the command ended by {status}");
            ExitCode::FAILURE
        }
    })
}
