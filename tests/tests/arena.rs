//! The result arena across two processes, on both drivers: the parent's `Arena` hands out
//! blocks, the child maps the chunks from their FDs once (`ArenaMapping`) and writes results
//! at `(chunk, offset)`; the parent reads exactly those bytes back.
//!
//! The handshake needs a pool FD; these tests give it one from a shareable pool they create
//! but do not install (the arena needs no pool, and not installing keeps the device's current
//! pool untouched when several tests share a process).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use poolipc::advanced::driver::{Driver, OwnedPool, PoolSharing, StreamHandle};
use poolipc::advanced::pool::{Arena, ArenaBlock};
use poolipc_tests::{Child, Env, both_drivers, num, spawn_child};

const KIB: u64 = 1 << 10;

/// A shareable pool for the handshake (not made current), its FD, and the child.
fn start(env: &Env) -> Result<(OwnedPool, OwnedFd, Child)> {
    let pool = OwnedPool::create(Arc::clone(&env.driver), env.device, PoolSharing::PosixFd)?;
    let fd = env.driver.mem_pool_export_fd(pool.handle())?;
    let child = spawn_child(env, fd.as_fd())?;
    Ok((pool, fd, child))
}

/// Lets the child exit, then tears down the arena and the pool, in that order.
fn finish(_env: &Env, child: Child, arena: Arena<dyn Driver>, pool: OwnedPool) -> Result<()> {
    let status = child.finish()?;
    ensure!(status.success(), "child ended with {status}");
    drop(arena);
    pool.close()?;
    Ok(())
}

fn arena(env: &Env, bytes: u64) -> Result<Arena<dyn Driver>> {
    Ok(Arena::new(Arc::clone(&env.driver), env.device, bytes)?)
}

/// Sends chunk `index`'s FD to the child and has it map the chunk.
fn map_in_child(child: &mut Child, arena: &Arena<dyn Driver>, index: u32) -> Result<()> {
    let info = arena
        .chunks()
        .find(|c| c.index == index)
        .with_context(|| format!("no chunk {index}"))?;
    let fd = arena.export_fd(index)?;
    let answer = child.call_with_fd(&format!("arena_map {index} {}", info.len), fd.as_fd())?;
    ensure!(num(&answer, 0)? != 0, "the child mapped at address 0");
    Ok(())
}

fn fill_in_child(child: &mut Child, b: &ArenaBlock, pattern: u32) -> Result<()> {
    child.call(&format!(
        "arena_fill {} {} {} {pattern:08x}",
        b.chunk, b.offset, b.len
    ))?;
    Ok(())
}

/// The block's bytes as the parent sees them.
fn read(env: &Env, b: &ArenaBlock) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; usize::try_from(b.len)?];
    env.driver.memcpy_dtoh(&mut buf, b.ptr)?;
    Ok(buf)
}

fn words(pattern: u32, len: u64) -> Result<Vec<u8>> {
    Ok(pattern.to_le_bytes().repeat(usize::try_from(len / 4)?))
}

/// Zeroes the whole of chunk 0 from the parent.
fn zero_first_chunk(env: &Env, arena: &Arena<dyn Driver>) -> Result<()> {
    let c = arena.chunks().next().context("no chunk")?;
    env.driver
        .memset_d8_async(c.ptr, 0, c.len, StreamHandle::NULL)?;
    env.driver.stream_synchronize(StreamHandle::NULL)?;
    Ok(())
}

both_drivers!(
    fn the_parent_reads_exactly_the_bytes_the_child_wrote_into_its_block(env) {
        let (pool, _fd, mut child) = start(env)?;
        let arena = arena(env, 1)?;
        zero_first_chunk(env, &arena)?;
        let before = arena.alloc(64 * KIB)?;
        let block = arena.alloc(64 * KIB)?;
        let after = arena.alloc(64 * KIB)?;
        map_in_child(&mut child, &arena, 0)?;

        fill_in_child(&mut child, &block, 0x5eed_0b0b)?;
        ensure!(read(env, &block)? == words(0x5eed_0b0b, block.len)?, "the block differs");
        ensure!(read(env, &before)? == vec![0; 64 * 1024], "the block before was touched");
        ensure!(read(env, &after)? == vec![0; 64 * 1024], "the block after was touched");

        // And the other way: what the parent writes, the child reads at the same offset.
        env.driver
            .memset_d32_async(before.ptr, 0xa11c_e5ed, before.len / 4, StreamHandle::NULL)?;
        env.driver.stream_synchronize(StreamHandle::NULL)?;
        let bad = child.call(&format!(
            "arena_check {} {} {} a11ce5ed",
            before.chunk, before.offset, before.len
        ))?;
        ensure!(num(&bad, 0)? == 0, "the child read {bad:?}");
        finish(env, child, arena, pool)
    }
);

both_drivers!(
    fn a_freed_block_is_reused_for_the_next_result_without_mapping_again(env) {
        let (pool, _fd, mut child) = start(env)?;
        let arena = arena(env, 1)?;
        map_in_child(&mut child, &arena, 0)?;
        let first = arena.alloc(256 * KIB)?;
        fill_in_child(&mut child, &first, 0x0000_0001)?;
        ensure!(read(env, &first)? == words(1, first.len)?, "first result differs");
        arena.free(first)?;

        let second = arena.alloc(256 * KIB)?;
        ensure!(second == first, "{second:?} is not the freed {first:?}");
        fill_in_child(&mut child, &second, 0x0000_0002)?;
        ensure!(read(env, &second)? == words(2, second.len)?, "second result differs");
        arena.free(second)?;
        ensure!(arena.stats().chunks == 1, "the arena grew");
        finish(env, child, arena, pool)
    }
);

both_drivers!(
    fn the_child_maps_a_chunk_the_arena_grew_while_it_was_attached(env) {
        let (pool, _fd, mut child) = start(env)?;
        let arena = arena(env, 1)?;
        let g = arena.capacity();
        map_in_child(&mut child, &arena, 0)?;
        let small = arena.alloc(64 * KIB)?;
        fill_in_child(&mut child, &small, 0x1111_1111)?;

        // A whole chunk's worth no longer fits beside `small`: the arena grows.
        let big = arena.alloc(g)?;
        ensure!(big.chunk == 1, "expected a new chunk, got {big:?}");
        let e = child.call_err(&format!("arena_fill 1 {} {} 22222222", big.offset, big.len))?;
        ensure!(e.contains("not mapped"), "{e}");

        map_in_child(&mut child, &arena, 1)?;
        fill_in_child(&mut child, &big, 0x2222_2222)?;
        ensure!(read(env, &big)? == words(0x2222_2222, big.len)?, "the new chunk's block differs");
        ensure!(read(env, &small)? == words(0x1111_1111, small.len)?, "chunk 0 changed");
        finish(env, child, arena, pool)
    }
);

both_drivers!(
    fn a_malformed_range_from_the_wire_is_a_named_error_in_the_child(env) {
        let (pool, _fd, mut child) = start(env)?;
        let arena = arena(env, 1)?;
        let len = arena.capacity();
        map_in_child(&mut child, &arena, 0)?;
        for (offset, n) in [(len, 4), (len - 4, 8), (u64::MAX, 4), (0, 0)] {
            let e = child.call_err(&format!("arena_fill 0 {offset} {n} ffffffff"))?;
            ensure!(
                e.contains(&format!("chunk 0, offset {offset}, len {n}")),
                "{offset}+{n}: {e}"
            );
        }
        let e = child.call_err("arena_fill 7 0 4 ffffffff")?;
        ensure!(e.contains("chunk 7"), "{e}");
        // The child is still serving, and a range inside the chunk works.
        child.call(&format!("arena_fill 0 {} 4 ffffffff", len - 4))?;
        finish(env, child, arena, pool)
    }
);
