//! `poolipc check --seeds N -- CMD`: runs a program on the simulated GPU under N seeds, one
//! after the other, and stops at the first run that fails, printing the seed that replays it.
//!
//! Each run gets `POOLIPC_DRIVER=sim`, `POOLIPC_SIM_SEED=<seed>` (0, 1, …) and
//! `POOLIPC_SIM_STRICT=1`, so that the first violation the race checker sees fails the run
//! even where the program does not look at its jobs' errors. A run fails when the command
//! exits non-zero (or by a signal).

use std::ffi::OsString;
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// How many seeds to try (0 to N-1).
    #[arg(long, default_value_t = 40)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// Do not set POOLIPC_SIM_STRICT=1: a run fails only when the command itself fails.
    #[arg(long)]
    no_strict: bool,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    command: Vec<OsString>,
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let (program, rest) = args.command.split_first().context("no command to run")?;
    for seed in args.first..args.first.saturating_add(args.seeds) {
        let mut c = Command::new(program);
        c.args(rest)
            .env(poolipc::driver::DRIVER_ENV, "sim")
            .env(poolipc::check::SEED_ENV, seed.to_string());
        if !args.no_strict {
            c.env(poolipc::check::STRICT_ENV, "1");
        }
        let status = c
            .status()
            .with_context(|| format!("running {}", program.to_string_lossy()))?;
        if !status.success() {
            eprintln!(
                "poolipc check: seed {seed} failed ({status}); replay it with\n  \
                 {}=sim {}={seed} {}=1 {}",
                poolipc::driver::DRIVER_ENV,
                poolipc::check::SEED_ENV,
                poolipc::check::STRICT_ENV,
                args.command
                    .iter()
                    .map(|a| a.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            return Ok(ExitCode::FAILURE);
        }
    }
    eprintln!(
        "poolipc check: {} seeds ({}..{}) ran clean on the simulated GPU",
        args.seeds,
        args.first,
        args.first.saturating_add(args.seeds)
    );
    Ok(ExitCode::SUCCESS)
}
