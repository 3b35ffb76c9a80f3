use super::*;
use crate::arena::Arena;
use poolipc_driver::sim::{SimConfig, SimDriver};
use poolipc_driver::{MockDriver, StreamHandle, VmmHandle};
use std::os::fd::{AsFd, OwnedFd};

fn sim() -> Arc<SimDriver> {
    let d = SimDriver::new(SimConfig::default()).unwrap();
    d.use_device(0).unwrap();
    Arc::new(d)
}

/// Another simulated process on the same machine, its device current.
fn peer(d: &SimDriver) -> Arc<SimDriver> {
    let w = d.peer();
    w.use_device(0).unwrap();
    Arc::new(w)
}

fn some_fd() -> OwnedFd {
    OwnedFd::from(std::fs::File::open("/dev/null").unwrap())
}

#[test]
fn a_chunk_mapped_from_the_parents_fd_reads_what_the_parent_wrote() {
    let p = sim();
    let arena = Arena::new(Arc::clone(&p), 0, 1).unwrap();
    let block = arena.alloc(8192).unwrap();
    p.memset_d32_async(block.ptr, 0xfeed_beef, 2048, StreamHandle::NULL)
        .unwrap();
    // The other process reads once this one saw the memset complete.
    p.stream_synchronize(StreamHandle::NULL).unwrap();
    let chunk = arena.chunks().next().unwrap();
    let fd = arena.export_fd(chunk.index).unwrap();

    let w = peer(&p);
    let mut mapping = ArenaMapping::new(Arc::clone(&w), 0);
    mapping
        .map_chunk(chunk.index, chunk.len, fd.as_fd())
        .unwrap();
    let ptr = mapping
        .resolve(block.chunk, block.offset, block.len)
        .unwrap();
    let mut back = vec![0u8; 8192];
    w.memcpy_dtoh(&mut back, ptr).unwrap();
    assert!(
        back.chunks_exact(4)
            .all(|x| x == 0xfeed_beef_u32.to_le_bytes())
    );
    drop(mapping);
    let v = p.violations();
    assert!(v.is_empty(), "{v:#?}");
}

#[test]
fn resolve_refuses_every_range_outside_its_chunk_by_name() {
    let p = sim();
    let arena = Arena::new(Arc::clone(&p), 0, 1).unwrap();
    let chunk = arena.chunks().next().unwrap();
    let fd = arena.export_fd(0).unwrap();
    let w = peer(&p);
    let mut m = ArenaMapping::new(w, 0);
    let base = m.map_chunk(0, chunk.len, fd.as_fd()).unwrap();
    let n = chunk.len;
    assert_eq!(m.resolve(0, 0, n).unwrap(), base);
    assert_eq!(m.resolve(0, n - 1, 1).unwrap(), base.offset(n - 1));
    for (offset, len) in [
        (n, 1),
        (n - 1, 2),
        (0, n + 1),
        (1, u64::MAX),
        (u64::MAX, 1),
        (0, 0),
    ] {
        let e = m.resolve(0, offset, len).unwrap_err();
        assert!(
            matches!(e, ArenaError::OutOfBounds { chunk: 0, offset: o, len: l, chunk_len }
                if o == offset && l == len && chunk_len == n),
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains(&format!("offset {offset}")), "{text}");
    }
    assert!(matches!(
        m.resolve(1, 0, 1),
        Err(ArenaError::UnknownChunk { chunk: 1 })
    ));
}

#[test]
fn mapping_a_chunk_index_twice_is_refused() {
    let p = sim();
    let arena = Arena::new(Arc::clone(&p), 0, 1).unwrap();
    let chunk = arena.chunks().next().unwrap();
    let fd = arena.export_fd(0).unwrap();
    let mut m = ArenaMapping::new(peer(&p), 0);
    m.map_chunk(0, chunk.len, fd.as_fd()).unwrap();
    assert!(matches!(
        m.map_chunk(0, chunk.len, fd.as_fd()),
        Err(ArenaError::AlreadyMapped { chunk: 0 })
    ));
    assert_eq!(m.len(), 1);
}

#[test]
fn a_chunk_length_off_the_granularity_is_refused_before_any_import() {
    let mut d = MockDriver::new();
    d.expect_vmm_granularity().returning(|_, _| Ok(2 << 20));
    d.expect_vmm_import_fd().never();
    let mut m = ArenaMapping::new(Arc::new(d), 0);
    let fd = some_fd();
    for len in [0, 1, (2 << 20) + 512] {
        let e = m.map_chunk(3, len, fd.as_fd()).unwrap_err();
        assert!(
            matches!(e, ArenaError::BadChunkLen { chunk: 3, len: l, .. } if l == len),
            "{e}"
        );
    }
    assert!(m.is_empty());
}

#[test]
fn a_chunk_whose_map_fails_releases_the_import() {
    let mut d = MockDriver::new();
    d.expect_vmm_granularity().returning(|_, _| Ok(2 << 20));
    d.expect_vmm_import_fd()
        .returning(|_| Ok(VmmHandle::mock(4)));
    d.expect_vmm_reserve()
        .returning(|_, _| Ok(DevicePtr(0x2000_0000)));
    d.expect_vmm_map().returning(|_, _, _| {
        Err(poolipc_driver::DriverError::Call {
            call: "cuMemMap",
            code: poolipc_driver::CuCode::INVALID_VALUE,
        })
    });
    d.expect_vmm_address_free()
        .times(1)
        .returning(|_, _| Ok(()));
    d.expect_vmm_release()
        .withf(|h| *h == VmmHandle::mock(4))
        .times(1)
        .returning(|_| Ok(()));
    let mut m = ArenaMapping::new(Arc::new(d), 0);
    let fd = some_fd();
    assert!(m.map_chunk(0, 2 << 20, fd.as_fd()).is_err());
    assert!(m.is_empty());
}

#[test]
fn drop_unmaps_frees_and_releases_every_mapped_chunk() {
    let mut d = MockDriver::new();
    d.expect_vmm_granularity().returning(|_, _| Ok(2 << 20));
    let mut next = 0;
    d.expect_vmm_import_fd().times(2).returning(move |_| {
        next += 1;
        Ok(VmmHandle::mock(next))
    });
    let mut va = 0;
    d.expect_vmm_reserve().times(2).returning(move |n, _| {
        va += 0x1000_0000;
        let _ = n;
        Ok(DevicePtr(va))
    });
    d.expect_vmm_map().times(2).returning(|_, _, _| Ok(()));
    d.expect_vmm_set_access()
        .withf(|_, _, dev, a| *dev == 5 && *a == poolipc_driver::Access::ReadWrite)
        .times(2)
        .returning(|_, _, _, _| Ok(()));
    d.expect_vmm_unmap().times(2).returning(|_, _| Ok(()));
    d.expect_vmm_address_free()
        .times(2)
        .returning(|_, _| Ok(()));
    d.expect_vmm_release().times(2).returning(|_| Ok(()));
    let mut m = ArenaMapping::new(Arc::new(d), 5);
    let fd = some_fd();
    m.map_chunk(0, 2 << 20, fd.as_fd()).unwrap();
    m.map_chunk(1, 4 << 20, fd.as_fd()).unwrap();
    drop(m);
}

#[test]
fn unmap_chunk_forgets_the_chunk_and_resolve_then_refuses_it() {
    let p = sim();
    let arena = Arena::new(Arc::clone(&p), 0, 1).unwrap();
    let chunk = arena.chunks().next().unwrap();
    let fd = arena.export_fd(0).unwrap();
    let mut m = ArenaMapping::new(peer(&p), 0);
    m.map_chunk(0, chunk.len, fd.as_fd()).unwrap();
    m.unmap_chunk(0).unwrap();
    assert!(matches!(
        m.resolve(0, 0, 1),
        Err(ArenaError::UnknownChunk { chunk: 0 })
    ));
    assert!(matches!(
        m.unmap_chunk(0),
        Err(ArenaError::UnknownChunk { chunk: 0 })
    ));
}
