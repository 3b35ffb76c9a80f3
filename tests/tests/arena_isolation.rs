//! One worker cannot read or write another worker's arena memory: every
//! arena chunk a worker is sent holds only that worker's blocks (its arena-copied inputs,
//! its arena results, its arena slices), so the mappings a worker has reach nothing of
//! another's. A rogue worker (`arena-snoop`) maps every chunk it is sent, read-write, reads
//! them all looking for another worker's bytes and overwrites them all; the other worker's
//! result must come through intact and the rogue must have seen none of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::OwnedStream;
use poolipc::advanced::types::ImportLimit;
use poolipc::{
    Error, JobOutput, Parent, ParentOptions, ResultMemory, ResultRefusal, Rung, StreamHandle,
    WorkerId,
};
use poolipc_tests::echo_jobs::{bytes_input, check_exact, filled, settle};
use poolipc_tests::{Env, both_drivers, rogue_command, worker_command};

const MIB: u64 = 1 << 20;

/// A parent with arena results, whose import limit puts every input over it: each input is
/// copied into the arena.
fn parent(env: &Env, max_bytes: Option<u64>) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        canary: false,
        results: ResultMemory::Arena {
            initial_bytes: 4 * MIB,
            max_bytes,
        },
        ..ParentOptions::default()
    };
    let p = Parent::new(Arc::clone(&env.driver), options)?;
    let limit = p.limits().import;
    p.lower_import_limit(ImportLimit::new(limit.chunk_bytes(), 0).context("limit")?)?;
    Ok(p)
}

/// An echo job of one input of `bytes` filled with `pattern`, copied into the arena; its
/// result is in the arena too.
fn arena_job(
    p: &Parent,
    w: WorkerId,
    bytes: u64,
    pattern: u32,
    stream: StreamHandle,
) -> Result<JobOutput> {
    let src = filled(p, bytes, pattern, stream)?;
    let out = p.run_job(w, &[bytes_input(src, bytes)], stream);
    p.driver().stream_synchronize(stream)?;
    p.pool().free(src, stream)?;
    p.driver().stream_synchronize(stream)?;
    let out = out?;
    ensure!(
        out.input_rungs == [Rung::ArenaCopy],
        "{:?}",
        out.input_rungs
    );
    ensure!(
        out.results[0].rung == Rung::Arena,
        "{:?}",
        out.results[0].rung
    );
    Ok(out)
}

/// What the snooping rogue reported: the chunks it was sent, as (index, len), and how many
/// words of each pattern it found, in the order given.
struct Snoop {
    chunks: Vec<(u32, u64)>,
    found: Vec<u64>,
}

/// Runs the rogue's job (an input of `bytes` filled with `pattern`, copied into the arena)
/// and reads its report from the job's error.
fn snoop(
    p: &Parent,
    rogue: WorkerId,
    bytes: u64,
    pattern: u32,
    stream: StreamHandle,
) -> Result<Snoop> {
    let message = match arena_job(p, rogue, bytes, pattern, stream) {
        Err(e) => match e.downcast::<Error>() {
            Ok(Error::Worker { message, .. }) => message,
            Ok(other) => bail!("the rogue's job failed otherwise: {other}"),
            Err(other) => return Err(other),
        },
        Ok(_) => bail!("the rogue's job succeeded: it reports by failing it"),
    };
    println!("{message}");
    let body = message
        .split("arena-snoop: ")
        .nth(1)
        .with_context(|| format!("no report in {message:?}"))?;
    let parts: Vec<&str> = body.split("; ").collect();
    let [chunks, found, _overwrote] = parts.as_slice() else {
        bail!("a report of another shape: {body:?}");
    };
    let chunks = chunks
        .trim_start_matches("chunks ")
        .split(',')
        .filter(|c| !c.is_empty())
        .map(|c| {
            let (i, l) = c.split_once(':').context("chunk")?;
            Ok((i.parse()?, l.parse()?))
        })
        .collect::<Result<Vec<(u32, u64)>>>()?;
    let found = found
        .trim_start_matches("found ")
        .split(',')
        .map(|f| Ok(f.split_once('=').context("count")?.1.parse()?))
        .collect::<Result<Vec<u64>>>()?;
    Ok(Snoop { chunks, found })
}

both_drivers!(
    /// B's input is copied into the arena and its result lands there; the rogue A, which
    /// maps the arena too, runs a job of its own after B's DONE. A maps, reads and
    /// overwrites every chunk it was sent: it finds its own input there and nothing of B's,
    /// and B's result is intact.
    fn a_worker_reads_and_writes_no_byte_of_another_workers_arena_blocks(env) {
        const B_PATTERN: u32 = 0xB0B0_1234;
        const A_PATTERN: u32 = 0xA0A0_5678;
        let p = parent(env, None)?;
        let b = p.spawn_worker(worker_command(env, None)?)?;
        let mut cmd = rogue_command(env, "arena-snoop")?;
        cmd.env(
            "POOLIPC_TEST_ROGUE_PATTERNS",
            format!("{B_PATTERN:x},{A_PATTERN:x}"),
        );
        let a = p.spawn_worker(cmd)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let out = arena_job(&p, b, MIB, B_PATTERN, stream)?;
        check_exact(&p, &out, 0, MIB, B_PATTERN)?;

        let seen = snoop(&p, a, MIB, A_PATTERN, stream)?;
        ensure!(!seen.chunks.is_empty(), "the rogue was sent no chunk: it proves nothing");
        ensure!(
            seen.found[1] >= MIB / 4 - 1,
            "the rogue did not find its own input through its mappings: {:?}",
            seen.found
        );
        ensure!(
            seen.found[0] == 0,
            "the rogue read {} words of the other worker's arena memory",
            seen.found[0]
        );
        check_exact(&p, &out, 0, MIB, B_PATTERN)
            .context("the other worker's arena result after the rogue's writes")?;
        // What the rogue was sent is its own arena, chunk for chunk.
        let own: Vec<(u32, u64)> = p
            .arena_of(a)
            .context("the rogue has no arena")?
            .chunks()
            .map(|c| (c.index, c.len))
            .collect();
        ensure!(seen.chunks == own, "the rogue was sent {:?}; its arena is {own:?}", seen.chunks);
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.arenas == 2, "{stats:?}");

        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left out");
        p.stop_worker(a)?;
        p.stop_worker(b)?;
        Ok(())
    }
);

both_drivers!(
    /// A reaped worker's arena grants nothing more; the chunk holding a result the caller
    /// still has stays (the result is intact), and once that result is dropped every chunk
    /// goes back to the device and the arena is forgotten.
    fn a_reaped_workers_arena_chunks_go_back_to_the_device_once_nothing_in_them_is_live(env) {
        let p = parent(env, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let out = arena_job(&p, w, MIB, 0x5EED_0001, stream)?;
        let held = p.arena_of(w).context("no arena")?.stats();
        ensure!(held.chunks == 1, "{held:?}");
        p.stop_worker(w)?;
        ensure!(settle(&p, stream)? == 1, "only the result is live");
        let kept = p.arena_of(w).context("the reaped worker's arena went with its result live")?.stats();
        ensure!(kept.chunks == 1 && kept.live_blocks == 1, "{kept:?}");
        check_exact(&p, &out, 0, MIB, 0x5EED_0001)?;
        drop(out);
        ensure!(settle(&p, stream)? == 0);
        // The IO thread looks for empty chunks of reaped workers once a second.
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.arena_of(w).is_some() {
            ensure!(Instant::now() < deadline, "the reaped worker's arena is still there: {:?}", p.arena_of(w).map(|a| a.stats()));
            std::thread::sleep(Duration::from_millis(20));
        }
        let stats = p.arena_stats().context("no arena")?;
        ensure!(
            stats.arenas == 0 && stats.alloc.capacity == 0 && stats.released_chunks == 1,
            "{stats:?}"
        );
        Ok(())
    }
);

both_drivers!(
    /// Every worker's arena draws on the parent's one cap: two workers' first chunks take
    /// it all, and a third worker's result is refused against the same cap.
    fn the_workers_arenas_share_the_parents_cap(env) {
        let p = parent(env, Some(8 * MIB))?;
        let ws = [
            p.spawn_worker(worker_command(env, None)?)?,
            p.spawn_worker(worker_command(env, None)?)?,
        ];
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        for (k, &w) in ws.iter().enumerate() {
            let out = arena_job(&p, w, MIB, 0xCA90_0000 + k as u32, stream)?;
            check_exact(&p, &out, 0, MIB, 0xCA90_0000 + k as u32)?;
        }
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.alloc.capacity == 8 * MIB && stats.arenas == 2, "{stats:?}");
        let third = p.spawn_worker(worker_command(env, None)?)?;
        let src = filled(&p, MIB, 0xCA90_0003, stream)?;
        let r = p.run_job(third, &[bytes_input(src, MIB)], stream);
        p.driver().stream_synchronize(stream)?;
        p.pool().free(src, stream)?;
        match r {
            Err(Error::Worker { refused: Some(ResultRefusal::ArenaFull { capacity, max, .. }), .. }) => {
                ensure!(capacity == 8 * MIB && max == 8 * MIB, "{capacity} {max}");
            }
            other => bail!("a third arena past the shared cap: {other:?}"),
        }
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.alloc.capacity == 8 * MIB, "{stats:?}");
        ensure!(settle(&p, stream)? == 0);
        for w in ws.into_iter().chain([third]) {
            p.stop_worker(w)?;
        }
        Ok(())
    }
);
