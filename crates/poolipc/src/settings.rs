//! What this process's sides can do and how they are tuned: the capabilities said in the
//! handshake ([`capabilities`]), the performance knobs ([`Tuning`]) and every environment
//! variable that sets one ([`env_number`]). A leaf: it imports nothing of the crate's.

use std::sync::OnceLock;
use std::time::Duration;

use poolipc_driver::Driver;
use poolipc_transport::{Capabilities, SendQueueLimits};

/// What the facade's sides can do on any device, said in the handshake.
pub(crate) const CAPABILITIES: Capabilities = Capabilities(
    Capabilities::POOL_POINTER.0 | Capabilities::IPC_EVENTS.0 | Capabilities::HOST_STAGING.0,
);

/// What an isolated worker ([`Trust::Isolated`](crate::Trust::Isolated)) is not offered and
/// does not claim: pool pointers and VMM handles, each a handle on the parent's memory beyond
/// the tensors lent.
pub(crate) const PARENT_MEMORY_HANDLES: Capabilities =
    Capabilities(Capabilities::POOL_POINTER.0 | Capabilities::VMM_HANDLE.0);

/// What this side can do on `device`: [`CAPABILITIES`], and the result arena
/// ([`Capabilities::VMM_ARENA`]) and VMM allocations lent by handle
/// ([`Capabilities::VMM_HANDLE`]) where the device has VMM with POSIX FD handles.
pub(crate) fn capabilities(driver: &dyn Driver, device: u32) -> Capabilities {
    match driver.device_info(device) {
        Ok(info) if info.vmm && info.vmm_posix_fd => {
            CAPABILITIES | Capabilities::VMM_ARENA | Capabilities::VMM_HANDLE
        }
        _ => CAPABILITIES,
    }
}

/// What a worker of this library announces: [`capabilities`], and long jobs (its
/// `Job::heartbeat` is then progress to the parent).
pub(crate) fn worker_capabilities(driver: &dyn Driver, device: u32) -> Capabilities {
    capabilities(driver, device) | Capabilities::LONG_JOBS
}

/// The number environment variable `name` holds, if it is set; one that is set to something
/// else is ignored with a warning naming it (the default applies), not taken for unset
/// silently.
pub(crate) fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    let value = std::env::var_os(name)?;
    let parsed = parse_env_number(value.to_str());
    // Once per variable: defaults are made more than once (every `ParentOptions`).
    static WARNED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let first = || {
        let mut warned = WARNED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let new = !warned.iter().any(|w| w == name);
        if new {
            warned.push(name.to_owned());
        }
        new
    };
    if parsed.is_none() && first() {
        tracing::warn!(
            "{name}={value:?} is not a whole number: ignored, the default applies",
            value = value.to_string_lossy()
        );
    }
    parsed
}

/// [`env_number`]'s reading of a value that is set (None: not valid UTF-8).
fn parse_env_number<T: std::str::FromStr>(value: Option<&str>) -> Option<T> {
    value.and_then(|v| v.trim().parse().ok())
}

/// How the parent trades CPU and memory for speed: its spins, its IO threads, the GPU's turns
/// between workers, its send queues and two copy-engine tricks. A performance knob, never a
/// choice of what runs or where: every value keeps every job correct.
///
/// [`Tuning::from_env`] (what [`ParentOptions::default`](crate::ParentOptions::default)
/// takes) reads these environment variables once per process; one set to something other
/// than a whole number is ignored with a warning naming it, and the default applies:
///
/// | Variable | Field | Default |
/// |---|---|---|
/// | `POOLIPC_SPIN_US` | [`spin`](Tuning::spin) | 400 µs with 4 or more CPUs, else 0 |
/// | `POOLIPC_SPIN_IN_FLIGHT_US` | [`spin_in_flight`](Tuning::spin_in_flight) | 1000 µs with 4 or more CPUs, else 0 |
/// | `POOLIPC_IO_THREADS` | [`io_threads`](Tuning::io_threads) | one per 4 CPUs, 1 to 4 |
/// | `POOLIPC_GPU_TURN_US` | [`gpu_turn`](Tuning::gpu_turn) | 0 (no turns) |
/// | `POOLIPC_READY_ASIDE` | [`ready_aside`](Tuning::ready_aside) | 1 (`0` turns it off) |
/// | `POOLIPC_COPY_THROUGH_HOST_BYTES` | [`copy_through_host`](Tuning::copy_through_host) | 2 MiB |
/// | `POOLIPC_WARM_COPIES` | [`warm_copies`](Tuning::warm_copies) | 0 (`1` turns it on) |
/// | `POOLIPC_DIRECT` | [`direct`](Tuning::direct) | 1 where the IO thread does not spin (`POOLIPC_SPIN_US` 0), else 0 |
///
/// Three more are read once by every process that has them set, a worker's included, and are
/// not fields (no parent decides them for another process):
///
/// | Variable | What | Default |
/// |---|---|---|
/// | `POOLIPC_SPIN_YIELD` | whether a spin-wait yields to the scheduler at each turn (`1`) or only hints the CPU (`0`) ([`Tuning::spin_yields`]) | 1 |
/// | `POOLIPC_WORKER_SPIN_US` | how long a worker looks for its next frame before it sleeps ([`Worker::set_spin`](crate::Worker::set_spin)) | as `POOLIPC_SPIN_US` |
/// | `POOLIPC_WORKER_READY_QUERY` | `1`: a worker looks at READY on the host first and skips its stream's wait where it completed (an experiment on the GPU's turn-taking) | 0 |
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// How long the IO loop looks again, without sleeping, after its last activity (a job
    /// finished, a command came) when no job is in flight: a caller's next submit then finds
    /// it awake instead of paying its wake-up (≈ 40 µs on the H200's host, measured: with
    /// 50 µs a 4 KiB round trip was 1.13× the bare-driver floor, with 400 µs 1.03–1.06×, the
    /// GPU's part unchanged). At most this much CPU after each job. Zero turns it off.
    /// `POOLIPC_SPIN_US` (microseconds).
    pub spin: Duration,
    /// How long, counted from a job's submit and from each frame a worker sends, the IO loop
    /// and a thread waiting on the job's [`JobHandle`](crate::JobHandle) look again before they sleep. A
    /// sleeping thread costs a wake-up when the answer comes (tens of microseconds each on
    /// a busy host, two per handoff: the loop's and the waiter's); without MPS a handoff
    /// takes ≈ 330 µs of GPU turn-taking, far past [`spin`](Tuning::spin), so this
    /// is what keeps those wake-ups out of it. At most this much CPU per job on each of the
    /// two threads; a long job sleeps after it. Zero turns it off.
    /// `POOLIPC_SPIN_IN_FLIGHT_US` (microseconds).
    pub spin_in_flight: Duration,
    /// Without MPS, the length of a worker's turn on the GPU (`None` or zero, the default:
    /// no turns). 2 ms is the turn measured: six times a change of context (about 330 µs on
    /// an H100) and some 60 small jobs' round trips. On the H100 it gave eight workers 0.64×
    /// one worker's jobs/s against 0.14× without turns; 5 ms gave 0.72×, each job then
    /// waiting longer for the turns ahead of it.
    /// While one worker holds the turn a submit to another waits; the holder takes jobs,
    /// any number at once, for the length of its turn, and after it none while another
    /// waits; the turn passes once its jobs ended (or it had none in flight for 100 µs).
    /// Turns go in the order they were asked for. Applies only where the driver says this
    /// process is not an MPS client; under MPS workers run at once.
    ///
    /// Why: without MPS the GPU runs one process's context at a time, and each change from
    /// one worker's context to another's cost about 330 µs on an H100: four workers given one
    /// 4 KiB job each in turn made 2545-2817 jobs/s, and with a job each in flight at once
    /// 7200 (the GPU changing at nearly every job), against 46000 for one worker alone; runs
    /// of 64 jobs per worker kept 0.73-0.78× of it (`bench/probes/turns_serial.py`). A turn
    /// amortizes the change over a run of jobs. The cost: a worker's job may wait for the
    /// turns of those ahead of it.
    ///
    /// The next in line that waited a turn and as long again past the holder's goes anyway,
    /// and so does every submit after it until the holder's jobs ended: a worker that keeps
    /// its job for long (a big kernel, host work, or on purpose) costs each other worker one
    /// such wait, not one a job. [`ParentStats::turn_waits`](crate::ParentStats::turn_waits),
    /// [`turn_wait_ns`](crate::ParentStats::turn_wait_ns) and
    /// [`turn_waits_ran_out`](crate::ParentStats::turn_waits_ran_out) count what they cost.
    ///
    /// Off by default, for what turns cost where they do not help: work of a worker's that is
    /// not on the GPU (host code, a kernel of its own longer than a turn) is serialized with
    /// the others' for up to two turns a job (on SimDriver, whose workers compute on the host,
    /// 8 workers fell from 3.6× one worker to 0.9×), and a slow or held job of one worker
    /// delays each other worker's submit by up to two turns. Turn them on for workers that
    /// run many small GPU jobs from threads of their own without MPS. `POOLIPC_GPU_TURN_US`
    /// (microseconds, 0 for none).
    pub gpu_turn: Option<Duration>,
    /// How many IO threads (rooms) serve the workers, each its own share of them (worker `id`
    /// goes to room `id % io_threads`) with its own copy of the ownership contract's
    /// machine: one thread's work per job (a frame read and written, the contract, the
    /// driver calls of a lend and of its DONE) then limits the rate of only its workers.
    /// `ParentStats::io_busy_ns` (printed by `poolipc bench --workers N`) says whether one
    /// is the limit. Each room spins as [`spin`](Tuning::spin) says, so more rooms
    /// spin more CPUs (a room spins only while its own workers are busy). 1 to 64; by
    /// default one per 4 CPUs, at least 1 and at most 4
    /// (4 on a 16-core GPU host): under MPS on an H100 with 16 cores, 4 workers gave 133005
    /// jobs/s with 4 IO threads against 65961 with one, 8 workers 132369 against 63554 (one
    /// IO thread 94–98 % busy), one worker the same (2026-12-05).
    /// `POOLIPC_IO_THREADS`.
    pub io_threads: usize,
    /// How many frames (and bytes) the IO loop keeps queued for a worker that does not read
    /// before it condemns that worker (1024 frames, 16 MiB by default).
    pub send_queue: SendQueueLimits,
    /// Whether the IO thread records a job's READY on a stream of its own, kept on a copy
    /// engine, whenever the caller's stream has nothing left to run (without MPS that spares
    /// the GPU a context switch each way; docs/facts.md). Measured on the H100 (2026-12-05):
    /// a round trip to one worker 20–37 µs with it, 287–294 µs without. Only where the
    /// driver says this process is not an MPS client: under MPS there is no change of
    /// context to spare, and READY goes on the caller's stream without a query.
    /// [`ParentStats::ready_recorded_aside`](crate::ParentStats::ready_recorded_aside)
    /// counts it. `POOLIPC_READY_ASIDE` (`0`: off; on otherwise).
    pub ready_aside: bool,
    /// The largest arena copy (an input copied in, and back when lent writable) the parent
    /// makes through pinned host memory, on copy engines, instead of device to device, where
    /// the driver says this process is not an MPS client (under MPS every copy goes device
    /// to device). Without MPS a device-to-device copy runs on the compute engine and costs
    /// the GPU a change of context to the worker's and back: on an H100 (driver 580,
    /// 2026-12-07, `bench/probes/arena_copy.c`) a 4 KiB job took 288 µs read-only and
    /// 325 µs copied back that way, 46 and 51 µs through the host; at 1 MiB 288 and 320
    /// against 54 and 106. Past a few MiB the host copies cost more than the change. Each IO
    /// thread keeps up to four pinned host buffers of this size (at most 64 MiB: a larger
    /// value is lowered to it), made when first needed and lent to one copy at a time; while
    /// all four are busy a copy goes device to device.
    /// [`ParentStats::copies_through_host`](crate::ParentStats::copies_through_host) counts
    /// them. `POOLIPC_COPY_THROUGH_HOST_BYTES` (bytes, `0`: none); 2 MiB by default.
    pub copy_through_host: u64,
    /// Whether the parent copies 1 MiB to the device and back once at
    /// [`Parent::new`](crate::Parent::new), through pageable host memory on the legacy
    /// stream (the experiment that led to [`ready_aside`](Tuning::ready_aside); a copy that
    /// fails is logged and changes nothing else). A worker makes the same copy at its
    /// handshake where its own environment says so. `POOLIPC_WARM_COPIES` (`1`: on).
    pub warm_copies: bool,
    /// Whether a caller's thread does the IO thread's work for its own job when it finds
    /// the IO thread asleep (not spinning): [`Parent::submit`](crate::Parent::submit) then
    /// places the job and writes its Lend itself, and a thread spinning on a job reads its
    /// worker's DONE itself, instead of handing each over and paying the IO thread's wake-up.
    /// A spinning IO thread is handed the job as before: that hop costs less than the loop's
    /// work on another core. The same code runs, on the caller's thread with the parent's device pushed
    /// current for the while; the IO thread keeps what is asynchronous (deadlines, exits,
    /// staging). Where the IO thread is busy, or a command is queued before the job, the job
    /// goes through it as before, so one thread's jobs keep their order.
    /// [`ParentStats::direct_lends`](crate::ParentStats::direct_lends) and
    /// [`direct_reads`](crate::ParentStats::direct_reads) count it. `POOLIPC_DIRECT` (`0`:
    /// off; on otherwise).
    ///
    /// On by default only where [`spin`](Tuning::spin) is zero (fewer than 4 CPUs, or
    /// `POOLIPC_SPIN_US=0`): there the IO thread sleeps between jobs and the path saves its
    /// wake-up (one worker under MPS on an H100: 37–39 µs a job against 39–45 µs without).
    /// Where the IO thread spins it gains nothing for one worker, and with eight workers
    /// sharing four IO threads, whose spins lapse under the load, callers and IO threads
    /// contend for the rooms (109k jobs/s against 140k without, same run).
    pub direct: bool,
}

/// The environment variable of [`Tuning::spin`].
pub(crate) const SPIN_ENV: &str = "POOLIPC_SPIN_US";
/// The environment variable of [`Tuning::spin_in_flight`].
pub(crate) const SPIN_IN_FLIGHT_ENV: &str = "POOLIPC_SPIN_IN_FLIGHT_US";
/// The environment variable of [`Tuning::gpu_turn`].
pub(crate) const GPU_TURN_ENV: &str = "POOLIPC_GPU_TURN_US";
/// The environment variable of [`Tuning::io_threads`].
pub(crate) const IO_THREADS_ENV: &str = "POOLIPC_IO_THREADS";
/// The environment variable of [`Tuning::ready_aside`].
pub(crate) const READY_ASIDE_ENV: &str = "POOLIPC_READY_ASIDE";
/// The environment variable of [`Tuning::copy_through_host`].
pub(crate) const COPY_THROUGH_HOST_ENV: &str = "POOLIPC_COPY_THROUGH_HOST_BYTES";
/// The environment variable of [`Tuning::warm_copies`].
pub(crate) const WARM_COPIES_ENV: &str = "POOLIPC_WARM_COPIES";
/// The environment variable of [`Tuning::direct`].
pub(crate) const DIRECT_ENV: &str = "POOLIPC_DIRECT";
/// The environment variable of [`Tuning::spin_yields`].
pub(crate) const SPIN_YIELD_ENV: &str = "POOLIPC_SPIN_YIELD";
/// The environment variable of a worker's spin.
pub(crate) const WORKER_SPIN_ENV: &str = "POOLIPC_WORKER_SPIN_US";
/// The environment variable of a worker's look at READY on the host.
pub(crate) const WORKER_READY_QUERY_ENV: &str = "POOLIPC_WORKER_READY_QUERY";

/// The most [`Tuning::io_threads`] may be.
pub const MAX_IO_THREADS: usize = 64;

impl Default for Tuning {
    /// The built-in defaults for this machine's CPUs, whatever the environment says.
    fn default() -> Tuning {
        let cpus = cpus();
        let spin = spin_for(cpus, Duration::from_micros(400));
        Tuning {
            spin,
            spin_in_flight: spin_for(cpus, Duration::from_millis(1)),
            gpu_turn: None,
            io_threads: io_threads_for(cpus),
            send_queue: SendQueueLimits::default(),
            ready_aside: true,
            copy_through_host: 2 << 20,
            warm_copies: false,
            direct: spin.is_zero(),
        }
    }
}

impl Tuning {
    /// [`Tuning::default`] with what the environment variables in the table above say, read
    /// once per process (later calls return the same values).
    pub fn from_env() -> Tuning {
        static READ: OnceLock<Tuning> = OnceLock::new();
        READ.get_or_init(|| Tuning::with_env(env_number)).clone()
    }

    /// The defaults with what `number` gives for each variable that is set.
    fn with_env(number: impl Fn(&str) -> Option<u64>) -> Tuning {
        let d = Tuning::default();
        let micros = |name: &str, or: Duration| number(name).map_or(or, Duration::from_micros);
        let spin = micros(SPIN_ENV, d.spin);
        Tuning {
            spin,
            spin_in_flight: micros(SPIN_IN_FLIGHT_ENV, d.spin_in_flight),
            gpu_turn: match number(GPU_TURN_ENV) {
                Some(0) | None => d.gpu_turn,
                Some(us) => Some(Duration::from_micros(us)),
            },
            io_threads: number(IO_THREADS_ENV)
                .map_or(d.io_threads, |n| usize::try_from(n).unwrap_or(usize::MAX)),
            send_queue: d.send_queue,
            ready_aside: number(READY_ASIDE_ENV).map_or(d.ready_aside, |v| v != 0),
            copy_through_host: number(COPY_THROUGH_HOST_ENV).unwrap_or(d.copy_through_host),
            warm_copies: number(WARM_COPIES_ENV).map_or(d.warm_copies, |v| v == 1),
            direct: number(DIRECT_ENV).map_or(spin.is_zero(), |v| v != 0),
        }
    }

    /// Whether this process's spin-waits yield to the scheduler at each turn
    /// (`POOLIPC_SPIN_YIELD`, read once per process; yes unless it is `0`). With several
    /// workers each spinning thread (callers, IO threads, workers) wants a core: a yielding
    /// spin lets a thread that has work run first on a machine with fewer cores than
    /// spinners, and costs one system call a turn where it has more.
    pub fn spin_yields() -> bool {
        static YIELDS: OnceLock<bool> = OnceLock::new();
        *YIELDS.get_or_init(|| env_number::<u8>(SPIN_YIELD_ENV).is_none_or(|v| v != 0))
    }
}

/// This machine's CPUs (1 where it cannot say).
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// `spin` where there are CPUs to spare for spinning (four or more), none otherwise.
fn spin_for(cpus: usize, spin: Duration) -> Duration {
    if cpus >= 4 { spin } else { Duration::ZERO }
}

/// The default IO threads for `cpus` CPUs: one per 4, at least 1, at most 4. Each room
/// serves its share of the workers; with one worker only one room is ever busy.
fn io_threads_for(cpus: usize) -> usize {
    (cpus / 4).clamp(1, 4)
}

/// Whether a worker looks at a job's READY on the host first (`POOLIPC_WORKER_READY_QUERY`
/// set to other than `0`, read once).
pub(crate) fn worker_ready_query() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| env_number::<u8>(WORKER_READY_QUERY_ENV).is_some_and(|v| v != 0))
}

/// A worker's spin unless `POOLIPC_WORKER_SPIN_US` says otherwise: 400 µs where the machine
/// has four or more CPUs, none otherwise ([`Tuning::spin`]'s rule).
pub(crate) fn worker_spin() -> Duration {
    env_number(WORKER_SPIN_ENV).map_or_else(
        || spin_for(cpus(), Duration::from_micros(400)),
        Duration::from_micros,
    )
}

/// Whether a worker makes the warm-up copy at its handshake (`POOLIPC_WARM_COPIES=1`, read
/// once).
pub(crate) fn worker_warm_copies() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| env_number::<u8>(WARM_COPIES_ENV) == Some(1))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Tuning, io_threads_for, parse_env_number};

    #[test]
    fn an_environment_number_is_read_trimmed_and_anything_else_is_none() {
        assert_eq!(parse_env_number::<u64>(Some("400")), Some(400));
        assert_eq!(parse_env_number::<usize>(Some(" 4\n")), Some(4));
        assert_eq!(parse_env_number::<u64>(Some("four")), None);
        assert_eq!(parse_env_number::<u64>(Some("-1")), None);
        assert_eq!(parse_env_number::<u64>(Some("")), None);
        assert_eq!(parse_env_number::<u64>(None), None, "not valid UTF-8");
    }

    #[test]
    fn the_default_io_threads_are_one_per_four_cpus_from_one_to_four() {
        for (cpus, want) in [
            (1, 1),
            (2, 1),
            (4, 1),
            (7, 1),
            (8, 2),
            (12, 3),
            (16, 4),
            (128, 4),
        ] {
            assert_eq!(io_threads_for(cpus), want, "{cpus} CPUs");
        }
    }

    #[test]
    fn each_variable_sets_its_field_and_the_others_keep_their_defaults() {
        let d = Tuning::default();
        assert_eq!(Tuning::with_env(|_| None), d, "nothing set");
        let set = |name: &'static str, value: u64| {
            Tuning::with_env(move |n| (n == name).then_some(value))
        };
        assert_eq!(set("POOLIPC_SPIN_US", 7).spin, Duration::from_micros(7));
        assert_eq!(
            set("POOLIPC_SPIN_IN_FLIGHT_US", 9).spin_in_flight,
            Duration::from_micros(9)
        );
        assert_eq!(set("POOLIPC_IO_THREADS", 3).io_threads, 3);
        assert_eq!(
            set("POOLIPC_GPU_TURN_US", 2000).gpu_turn,
            Some(Duration::from_millis(2))
        );
        assert_eq!(set("POOLIPC_GPU_TURN_US", 0).gpu_turn, None, "0: no turns");
        assert!(!set("POOLIPC_READY_ASIDE", 0).ready_aside);
        assert!(
            set("POOLIPC_READY_ASIDE", 2).ready_aside,
            "only 0 turns it off"
        );
        assert_eq!(
            set("POOLIPC_COPY_THROUGH_HOST_BYTES", 4096).copy_through_host,
            4096
        );
        assert_eq!(
            set("POOLIPC_COPY_THROUGH_HOST_BYTES", 0).copy_through_host,
            0,
            "0: every arena copy device to device"
        );
        assert!(set("POOLIPC_WARM_COPIES", 1).warm_copies);
        assert!(
            !set("POOLIPC_WARM_COPIES", 2).warm_copies,
            "only 1 turns it on"
        );
        assert_eq!(
            d.direct,
            d.spin.is_zero(),
            "on by default where the IO thread does not spin"
        );
        assert!(set("POOLIPC_SPIN_US", 0).direct, "no spin: on");
        assert!(!set("POOLIPC_SPIN_US", 50).direct, "a spin: off");
        assert!(
            !Tuning::with_env(|n| match n {
                "POOLIPC_SPIN_US" => Some(0),
                "POOLIPC_DIRECT" => Some(0),
                _ => None,
            })
            .direct,
            "no spin, but turned off"
        );
        assert!(!set("POOLIPC_DIRECT", 0).direct);
        assert!(set("POOLIPC_DIRECT", 1).direct);
        let spin = set("POOLIPC_SPIN_US", 7);
        assert_eq!(
            Tuning {
                spin: d.spin,
                direct: d.direct,
                ..spin
            },
            d,
            "the spin's variable changes the spin and the direct path's default, nothing else"
        );
    }
}
