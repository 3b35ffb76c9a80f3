//! The facade end to end: a parent and a real worker process handing tensors both ways.

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::{DType, Error, Input, Parent, ParentOptions, Rung, TensorDesc, echo};
use poolipc_driver::{DevicePtr, Driver, StreamHandle};
use poolipc_pool::ImportLimit;
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;

fn parent(env: &Env, limit: ImportLimit) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        limit,
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// An allocation from the shared pool filled with a 32-bit pattern.
fn filled(p: &Parent, bytes: u64, pattern: u32, stream: StreamHandle) -> Result<DevicePtr> {
    let ptr = p.pool().alloc(bytes, stream)?;
    p.driver()
        .memset_d32_async(ptr, pattern, bytes.div_ceil(4), stream)?;
    Ok(ptr)
}

fn read(d: &dyn Driver, ptr: DevicePtr, bytes: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; bytes];
    d.memcpy_dtoh(&mut v, ptr)?;
    Ok(v)
}

struct Case {
    name: &'static str,
    alloc: u64,
    offset: u64,
    desc: TensorDesc,
    pattern: u32,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "f32 1 MiB",
            alloc: MIB,
            offset: 0,
            desc: TensorDesc::contiguous(DType::F32, &[256, 1024]),
            pattern: 0x3F80_0000,
        },
        Case {
            name: "bf16 odd size",
            alloc: 24_690,
            offset: 0,
            desc: TensorDesc::contiguous(DType::BF16, &[12_345]),
            pattern: 0x3F80_3F80,
        },
        Case {
            name: "i64 view at an offset",
            alloc: 3 * MIB,
            offset: MIB + 8,
            desc: TensorDesc::contiguous(DType::I64, &[1000]),
            pattern: 7,
        },
        Case {
            name: "u8 13 bytes",
            alloc: 13,
            offset: 0,
            desc: TensorDesc::contiguous(DType::U8, &[13]),
            pattern: 0x0101_0101,
        },
    ]
}

both_drivers!(
    fn a_job_lends_inputs_of_several_dtypes_and_gets_results_back(env) {
        let mut p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let stream = d.stream_create()?;
        let baseline = p.pool().stats()?.used_current;
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let cases = cases();
        let mut allocs = Vec::new();
        let mut inputs = Vec::new();
        for c in &cases {
            let base = filled(&p, c.alloc, c.pattern, stream)?;
            allocs.push(base);
            inputs.push(Input { ptr: base.offset(c.offset), desc: c.desc.clone() });
        }
        for round in 0..2 {
            let out = p.run_job(worker, &inputs, stream)?;
            ensure!(out.input_rungs.iter().all(|r| *r == Rung::PoolPointer), "{:?}", out.input_rungs);
            ensure!(out.results.len() == cases.len(), "{} results", out.results.len());
            d.stream_synchronize(stream)?;
            for (i, (c, r)) in cases.iter().zip(&out.results).enumerate() {
                let bytes = c.desc.extent_bytes()?;
                ensure!(r.bytes == bytes && r.shape.shape == c.desc.shape, "{}: result {r:?}", c.name);
                let got = read(&*d, r.ptr, bytes as usize)?;
                let want_marker = echo::marker(i).to_le_bytes();
                ensure!(got[..4] == want_marker[..got.len().min(4)], "{} round {round}: no marker", c.name);
                let pat = c.pattern.to_le_bytes();
                for (k, b) in got.iter().enumerate().skip(4) {
                    ensure!(*b == pat[(k + c.offset as usize) % 4], "{} round {round}: byte {k} is {b:#x}", c.name);
                }
                p.pool().free(r.ptr, stream)?;
            }
        }
        for a in allocs {
            p.pool().free(a, stream)?;
        }
        d.stream_synchronize(stream)?;
        ensure!(p.pool().stats()?.used_current == baseline, "memory left in use: {}", p.pool().stats()?);
        let status = p.stop_worker(worker)?;
        ensure!(status.is_some_and(|s| s.success()), "worker exit: {status:?}");
        Ok(())
    }
);

fn killed_at(env: &Env, step: &str) -> Result<()> {
    let mut p = parent(env, ImportLimit::default())?;
    let d = Arc::clone(p.driver());
    let stream = d.stream_create()?;
    let baseline = p.pool().stats()?.used_current;
    let input = filled(&p, 4 * MIB, 0x1234_5678, stream)?;
    let inputs = [Input {
        ptr: input,
        desc: TensorDesc::contiguous(DType::F32, &[MIB]),
    }];
    for attempt in 0..2 {
        let doomed = p.spawn_worker(worker_command(env, Some(step))?)?;
        match p.run_job(doomed, &inputs, stream) {
            Err(Error::JobFailed { .. }) => {}
            other => anyhow::bail!("{step} attempt {attempt}: expected JobFailed, got {other:?}"),
        }
        d.stream_synchronize(stream)?;
        let used = p.pool().stats()?.used_current;
        ensure!(
            used == baseline + 4 * MIB,
            "{step}: {used} bytes in use after the failed job"
        );
        // The next job, on a fresh worker, succeeds.
        let fresh = p.spawn_worker(worker_command(env, None)?)?;
        let out = p.run_job(fresh, &inputs, stream)?;
        d.stream_synchronize(stream)?;
        for r in &out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.stop_worker(fresh)?;
    }
    p.pool().free(input, stream)?;
    d.stream_synchronize(stream)?;
    ensure!(
        p.pool().stats()?.used_current == baseline,
        "memory left in use"
    );
    Ok(())
}

both_drivers!(
    fn a_worker_dying_after_import_fails_its_job_only(env) {
        killed_at(env, "after-import")
    }
);

both_drivers!(
    fn a_worker_dying_after_the_result_grant_fails_its_job_only(env) {
        killed_at(env, "after-grant")
    }
);

both_drivers!(
    fn a_worker_dying_after_writing_before_done_fails_its_job_only(env) {
        killed_at(env, "after-write")
    }
);

both_drivers!(
    fn a_tensor_over_the_import_limit_is_refused_clearly_and_the_parent_goes_on(env) {
        // A 2-chunk limit of 1 MiB chunks stands in for the 128 × 32 MiB rule.
        let mut p = parent(env, ImportLimit::new(MIB, 2).expect("limit"))?;
        let d = Arc::clone(p.driver());
        let stream = d.stream_create()?;
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let big = filled(&p, 4 * MIB, 1, stream)?;
        let small = filled(&p, MIB, 2, stream)?;
        let err = p
            .run_job(worker, &[Input { ptr: big, desc: TensorDesc::contiguous(DType::U8, &[4 * MIB]) }], stream)
            .expect_err("over the limit");
        ensure!(matches!(err, Error::NoRung(_)), "{err}");
        ensure!(err.to_string().contains("over the pointer-import limit"), "{err}");
        let report = p.canary_report(worker).expect("the battery ran");
        ensure!(report.ok(), "{report}");
        ensure!(!report.skipped.is_empty(), "over-limit canaries should be skipped: {report}");
        let out = p.run_job(worker, &[Input { ptr: small, desc: TensorDesc::contiguous(DType::U8, &[MIB]) }], stream)?;
        d.stream_synchronize(stream)?;
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(big, stream)?;
        p.pool().free(small, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    fn a_rogue_peer_is_refused_and_the_parent_serves_the_next_worker(env) {
        let mut p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let stream = d.stream_create()?;
        // Not a worker: writes garbage on the inherited socket and exits.
        let mut rogue = std::process::Command::new("sh");
        rogue.args(["-c", "printf 'GARBAGE-NOT-A-FRAME-AT-ALL' >&$POOLIPC_FD; sleep 0.2"]);
        let err = p.spawn_worker(rogue).expect_err("a rogue peer");
        println!("{:?}: rogue peer: {err}", env.kind());
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let input = filled(&p, MIB, 3, stream)?;
        let out = p.run_job(worker, &[Input { ptr: input, desc: TensorDesc::contiguous(DType::U8, &[MIB]) }], stream)?;
        d.stream_synchronize(stream)?;
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(input, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);
