//! The environment a spawned worker inherits: all of the parent's by default (as
//! `std::process::Command` does), or, with [`restrict_env`], only the variables the caller
//! names plus those poolipc and CUDA need ([`ALWAYS_KEPT`], [`ALWAYS_KEPT_PREFIXES`]).
//!
//! The threat is a parent whose environment holds secrets (ComfyUI's, with API keys) handing
//! them to a third-party worker that has no use for them. Variables set on the `Command`
//! itself (`cmd.env(..)`) are always kept: the caller chose them for this worker. The
//! variables [`Parent::spawn_worker`](crate::Parent::spawn_worker) and the transport add
//! afterwards (the simulated machine's locator, `POOLIPC_FD`) are unaffected.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt as _;
use std::process::Command;

/// Variables a restricted worker inherits whatever the allowlist says: what a program needs
/// to run at all (`PATH`, `HOME`, `TMPDIR`, `LANG`), to find its libraries (`LD_LIBRARY_PATH`,
/// `PYTHONPATH`). None of them is expected to hold a secret.
pub(crate) const ALWAYS_KEPT: &[&str] = &[
    "PATH",
    "HOME",
    "TMPDIR",
    "LANG",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
];

/// Prefixes of variables a restricted worker inherits: poolipc's own (`POOLIPC_`: driver
/// choice, device, connect variables, spin and probe switches), CUDA's (`CUDA_`: visible
/// devices, MPS pipe directory, module loading) and the locale's (`LC_`).
pub(crate) const ALWAYS_KEPT_PREFIXES: &[&str] = &["POOLIPC_", "CUDA_", "LC_"];

/// Makes `cmd` start with only the parent's variables named in `allow`, plus those poolipc
/// and CUDA need, plus whatever was set on `cmd` itself. Call it before
/// [`Parent::spawn_worker`](crate::Parent::spawn_worker): a parent whose environment holds
/// secrets (ComfyUI's, with API keys) then hands none of them to a third-party worker.
///
/// Always kept: `PATH`, `HOME`, `TMPDIR`, `LANG`, `LD_LIBRARY_PATH`, `PYTHONPATH`, and every
/// variable starting `POOLIPC_` (driver choice, device, connect variables, spin and probe
/// switches), `CUDA_` (visible devices, MPS pipe directory, module loading) or `LC_`. The
/// variables `spawn_worker` and the transport add afterwards (the simulated machine's
/// locator, `POOLIPC_FD`) are unaffected.
pub fn restrict_env<I, S>(cmd: &mut Command, allow: I)
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    restrict_env_from(cmd, allow, std::env::vars_os());
}

/// Whether a restricted worker inherits `name` from the parent, given the caller's list.
#[must_use]
pub(crate) fn kept(name: &OsStr, allow: &HashSet<OsString>) -> bool {
    let bytes = name.as_bytes();
    allow.contains(name)
        || ALWAYS_KEPT.iter().any(|k| k.as_bytes() == bytes)
        || ALWAYS_KEPT_PREFIXES
            .iter()
            .any(|p| bytes.starts_with(p.as_bytes()))
}

fn restrict_env_from<I, S>(
    cmd: &mut Command,
    allow: I,
    parent: impl Iterator<Item = (OsString, OsString)>,
) where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let allow: HashSet<OsString> = allow.into_iter().map(|s| s.as_ref().to_owned()).collect();
    let explicit: Vec<(OsString, Option<OsString>)> = cmd
        .get_envs()
        .map(|(k, v)| (k.to_owned(), v.map(OsStr::to_owned)))
        .collect();
    cmd.env_clear();
    for (k, v) in parent {
        if kept(&k, &allow) {
            cmd.env(k, v);
        }
    }
    for (k, v) in explicit {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn child_env(cmd: &mut Command) -> Vec<String> {
        let out = cmd.arg("-0").output().expect("run env");
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout)
            .split_terminator('\0')
            .map(str::to_owned)
            .collect()
    }

    fn parent_env() -> impl Iterator<Item = (OsString, OsString)> {
        [
            ("PATH", "/usr/bin:/bin"),
            ("OPENAI_API_KEY", "sk-secret"),
            ("HF_HOME", "/data/hf"),
            ("POOLIPC_DRIVER", "sim"),
            ("CUDA_VISIBLE_DEVICES", "1"),
            ("CUDAX", "not a CUDA_ variable"),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
    }

    #[test]
    fn a_variable_not_on_the_allowlist_does_not_reach_the_worker() {
        let mut cmd = Command::new("/usr/bin/env");
        cmd.env("OMP_NUM_THREADS", "4");
        restrict_env_from(&mut cmd, ["HF_HOME"], parent_env());
        let mut got = child_env(&mut cmd);
        got.sort();
        assert_eq!(
            got,
            [
                "CUDA_VISIBLE_DEVICES=1",
                "HF_HOME=/data/hf",
                "OMP_NUM_THREADS=4",
                "PATH=/usr/bin:/bin",
                "POOLIPC_DRIVER=sim",
            ]
        );
    }

    #[test]
    fn without_the_allowlist_the_worker_inherits_everything() {
        // Today's behaviour, kept as the default: Command inherits the whole environment.
        let got = child_env(&mut Command::new("/usr/bin/env"));
        let ours = std::env::vars_os().count();
        assert_eq!(got.len(), ours, "{got:?}");
    }
}
