//! The process parent's options as Python gives them ([`ParentConfig`], the package's
//! `ParentConfig`), checked and turned into the facade's [`ParentOptions`], and compared with
//! those of a parent that exists already.

use std::time::Duration;

use poolipc::{ParentOptions, ResultMemory};
use pyo3::prelude::*;

/// The process parent's options as Python asks for them: the package's `ParentConfig` (the
/// keyword arguments of `install_pool` and `Parent`), a dict with every key, each None when
/// not given (the default on first creation, whatever the process's parent has afterwards).
/// The deadlines are in seconds.
#[derive(Clone, Debug, Default, FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct ParentConfig {
    handoff_timeout: Option<f64>,
    stop_timeout: Option<f64>,
    handshake_timeout: Option<f64>,
    frame_timeout: Option<f64>,
    /// How long a worker has to finish a cancelled job before it is killed
    /// ([`ParentOptions::cancel_grace`]).
    cancel_grace: Option<f64>,
    /// Where results go when a job names no allocator: `"pool"` or `"arena"`.
    results: Option<String>,
    /// The result arena's first chunk (and growth step), in bytes.
    arena_bytes: Option<u64>,
    /// The result arena's cap, in bytes.
    arena_max_bytes: Option<u64>,
    /// Whether workers get no handle on the parent's pool by default ([`ParentOptions::isolated`];
    /// `spawn(..., isolated=)` chooses per worker).
    isolated: Option<bool>,
    /// The IO threads that serve the workers ([`Tuning::io_threads`](poolipc::Tuning::io_threads)).
    io_threads: Option<usize>,
    /// Without MPS, the length of a worker's turn on the GPU, in seconds; 0
    /// for no turns ([`Tuning::gpu_turn`](poolipc::Tuning::gpu_turn)).
    gpu_turn: Option<f64>,
}

/// `gpu_turn` as the facade takes it: `secs` seconds, None for 0; an error naming the
/// value for a negative or non-finite one.
fn turn_length(secs: f64) -> Result<Option<Duration>, String> {
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!(
            "poolipc: gpu_turn={secs:?} is not a turn: give seconds, 0 (no turns) or more"
        ));
    }
    if secs == 0.0 {
        return Ok(None);
    }
    Duration::try_from_secs_f64(secs)
        .map(Some)
        .map_err(|e| format!("poolipc: gpu_turn={secs:?}: {e}"))
}

/// A parent's `gpu_turn` in seconds, 0 for none.
pub(crate) fn turn_secs(o: &ParentOptions) -> f64 {
    o.tuning.gpu_turn.map_or(0.0, |d| d.as_secs_f64())
}

/// [`ParentConfig::arena_bytes`]' default: the arena's first chunk, and its growth step.
pub(crate) const DEFAULT_ARENA_BYTES: u64 = 256 << 20;

/// What `results=` names: the shared pool or the result arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Results {
    Pool,
    Arena,
}

impl Results {
    pub(crate) fn parse(s: &str) -> Result<Results, String> {
        match s {
            "pool" => Ok(Results::Pool),
            "arena" => Ok(Results::Arena),
            other => Err(format!(
                "poolipc: results={other:?} is not a result memory; use \"pool\" or \"arena\""
            )),
        }
    }

    /// Which of the two a parent's options pick.
    pub(crate) fn of(memory: &ResultMemory) -> Results {
        match memory {
            ResultMemory::Arena { .. } => Results::Arena,
            _ => Results::Pool,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Results::Pool => "pool",
            Results::Arena => "arena",
        }
    }
}

/// A deadline's name, its requested value, and its field of [`ParentOptions`].
type Field = (
    &'static str,
    Option<f64>,
    fn(&ParentOptions) -> Duration,
    fn(&mut ParentOptions) -> &mut Duration,
);

impl ParentConfig {
    /// Each deadline with its name, the requested value, and its field of [`ParentOptions`]
    /// (to read and to set).
    fn fields(&self) -> [Field; 5] {
        [
            (
                "handoff_timeout",
                self.handoff_timeout,
                |o| o.handoff_timeout,
                |o| &mut o.handoff_timeout,
            ),
            (
                "stop_timeout",
                self.stop_timeout,
                |o| o.stop_timeout,
                |o| &mut o.stop_timeout,
            ),
            (
                "handshake_timeout",
                self.handshake_timeout,
                |o| o.handshake_timeout,
                |o| &mut o.handshake_timeout,
            ),
            (
                "frame_timeout",
                self.frame_timeout,
                |o| o.frame_timeout,
                |o| &mut o.frame_timeout,
            ),
            (
                "cancel_grace",
                self.cancel_grace,
                |o| o.cancel_grace,
                |o| &mut o.cancel_grace,
            ),
        ]
    }

    /// The deadlines of `o` by name, in seconds: what `Parent.options()` says of them.
    pub(crate) fn deadlines(o: &ParentOptions) -> impl Iterator<Item = (&'static str, f64)> {
        ParentConfig::default()
            .fields()
            .into_iter()
            .map(move |(name, _, get, _)| (name, get(o).as_secs_f64()))
    }

    /// The facade's options: the defaults, with what was asked for. Checks every value,
    /// whether or not this call creates the process's parent.
    pub(crate) fn options(&self, device: u32) -> Result<ParentOptions, String> {
        let mut o = ParentOptions {
            device,
            ..ParentOptions::default()
        };
        for (name, value, _, field) in self.fields() {
            if let Some(secs) = value {
                *field(&mut o) = seconds(name, secs)?;
            }
        }
        let results = self.results.as_deref().map(Results::parse).transpose()?;
        if let Some(isolated) = self.isolated {
            o.isolated = isolated;
        }
        if let Some(n) = self.io_threads {
            if !(1..=poolipc::MAX_IO_THREADS).contains(&n) {
                return Err(format!(
                    "poolipc: io_threads={n} is not a count of IO threads: give 1 to {}",
                    poolipc::MAX_IO_THREADS
                ));
            }
            o.tuning.io_threads = n;
        }
        if let Some(secs) = self.gpu_turn {
            o.tuning.gpu_turn = turn_length(secs)?;
        }
        if self.arena_bytes == Some(0) {
            return Err(
                "poolipc: arena_bytes=0: the arena needs a first chunk of more than 0 \
                        bytes"
                    .into(),
            );
        }
        if let (Some(first), Some(max)) = (self.arena_bytes, self.arena_max_bytes)
            && max < first
        {
            return Err(format!(
                "poolipc: arena_max_bytes={max} is less than arena_bytes={first}: the cap must \
                 hold the first chunk"
            ));
        }
        if results == Some(Results::Arena) {
            o.results = ResultMemory::Arena {
                initial_bytes: self
                    .arena_bytes
                    .unwrap_or(match self.arena_max_bytes {
                        Some(max) => DEFAULT_ARENA_BYTES.min(max),
                        None => DEFAULT_ARENA_BYTES,
                    })
                    .max(1),
                max_bytes: self.arena_max_bytes,
            };
        }
        Ok(o)
    }

    /// On creation: arena sizes mean nothing without `results="arena"`.
    pub(crate) fn check_creation(&self) -> Result<(), String> {
        let arena = self.results.as_deref() == Some("arena");
        if !arena && (self.arena_bytes.is_some() || self.arena_max_bytes.is_some()) {
            return Err(
                "poolipc: arena_bytes and arena_max_bytes size the result arena: pass \
                 results=\"arena\" with them"
                    .into(),
            );
        }
        Ok(())
    }

    /// What in `self` differs from the options the process's parent was made with.
    pub(crate) fn clashes(&self, made: &ParentOptions) -> Vec<String> {
        let mut out = Vec::new();
        for (name, value, get, _) in self.fields() {
            if let Some(secs) = value {
                let have = get(made);
                let want = seconds(name, secs).unwrap_or(Duration::MAX);
                // Compared in the units Python gave them (a float of seconds round-trips
                // through Duration to within a nanosecond).
                if want.abs_diff(have) > Duration::from_micros(1) {
                    out.push(format!(
                        "{name}={secs:?} (the process's parent has {:?})",
                        have.as_secs_f64()
                    ));
                }
            }
        }
        if let Some(want) = self.isolated
            && want != made.isolated
        {
            out.push(format!(
                "isolated={} (the process's parent has {})",
                if want { "True" } else { "False" },
                if made.isolated { "True" } else { "False" }
            ));
        }
        if let Some(n) = self.io_threads
            && n != made.tuning.io_threads
        {
            out.push(format!(
                "io_threads={n} (the process's parent has {})",
                made.tuning.io_threads
            ));
        }
        if let Some(secs) = self.gpu_turn
            && let Ok(want) = turn_length(secs)
            && want
                .unwrap_or_default()
                .abs_diff(made.tuning.gpu_turn.unwrap_or_default())
                > Duration::from_micros(1)
        {
            out.push(format!(
                "gpu_turn={secs:?} (the process's parent has {:?})",
                turn_secs(made)
            ));
        }
        let (have, first, max) = match made.results {
            ResultMemory::Arena {
                initial_bytes,
                max_bytes,
            } => (Results::Arena, Some(initial_bytes), max_bytes),
            _ => (Results::Pool, None, None),
        };
        if let Some(want) = self.results.as_deref().and_then(|r| Results::parse(r).ok())
            && want != have
        {
            out.push(format!(
                "results={:?} (the process's parent has {:?})",
                want.name(),
                have.name()
            ));
        }
        if let Some(b) = self.arena_bytes
            && Some(b) != first
        {
            out.push(format!(
                "arena_bytes={b} (the process's parent has {})",
                first.map_or("no arena".to_owned(), |f| f.to_string())
            ));
        }
        if let Some(m) = self.arena_max_bytes
            && (have != Results::Arena || Some(m) != max)
        {
            out.push(format!(
                "arena_max_bytes={m} (the process's parent has {})",
                match (have, max) {
                    (Results::Pool, _) => "no arena".to_owned(),
                    (Results::Arena, None) => "no cap".to_owned(),
                    (Results::Arena, Some(x)) => x.to_string(),
                }
            ));
        }
        out
    }
}

/// A deadline in seconds as a `Duration`: finite and more than zero.
fn seconds(name: &str, secs: f64) -> Result<Duration, String> {
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!(
            "poolipc: {name}={secs:?} is not a deadline: give seconds, more than 0"
        ));
    }
    Duration::try_from_secs_f64(secs)
        .map_err(|e| format!("poolipc: {name}={secs:?} is not a deadline: {e}"))
}
