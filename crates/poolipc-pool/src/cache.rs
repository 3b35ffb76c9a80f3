//! The worker's import cache: one import per exported allocation, refcounted.
//!
//! Importing the same exported pointer twice in one process returns an alias whose first
//! free unmaps both (NVIDIA bug 5570902; cuda-python keeps a cache keyed on the export bytes
//! for the same reason). So a worker imports each allocation once, counts its users, and frees
//! the import when the last one lets go.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Arc;

use poolipc_driver::{
    DevicePtr, Driver, DriverError, ExportBlob, ImportedPointer, PoolHandle, StreamHandle,
};

/// Errors of the import cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// A release of an export this cache does not hold.
    #[error("released an import that is not held (export {0:?})")]
    NotHeld(ExportBlob),
    /// The driver refused the import or its free.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

struct Entry<R: Deref<Target: Driver>> {
    import: ImportedPointer<R>,
    users: u32,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for Entry<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("ptr", &self.import.ptr())
            .field("users", &self.users)
            .finish()
    }
}

/// What [`ImportCache::release`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// Other users remain; the import stays.
    StillHeld {
        /// How many.
        users: u32,
    },
    /// That was the last user: the import at this address was freed.
    Freed(DevicePtr),
}

/// One import per exported allocation, shared by refcount (worker side). Dropped, it frees
/// the imports it still holds on the legacy default stream ([`ImportedPointer`]'s drop);
/// [`free_all`](ImportCache::free_all) frees them on a stream of the caller's choice.
pub struct ImportCache<R: Deref<Target: Driver> = Arc<dyn Driver>> {
    entries: HashMap<ExportBlob, Entry<R>>,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for ImportCache<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportCache")
            .field("entries", &self.entries)
            .finish()
    }
}

impl<R: Deref<Target: Driver>> Default for ImportCache<R> {
    fn default() -> Self {
        ImportCache {
            entries: HashMap::new(),
        }
    }
}

impl<R: Deref<Target: Driver>> ImportCache<R> {
    /// An empty cache.
    #[must_use]
    pub fn new() -> ImportCache<R> {
        ImportCache::default()
    }

    /// The import of `data`, made with `import` the first time and shared after.
    pub fn acquire_with<E>(
        &mut self,
        data: &ExportBlob,
        import: impl FnOnce(&ExportBlob) -> Result<ImportedPointer<R>, E>,
    ) -> Result<DevicePtr, E> {
        if let Some(e) = self.entries.get_mut(data) {
            e.users += 1;
            tracing::trace!(ptr = ?e.import.ptr(), users = e.users, "import shared");
            return Ok(e.import.ptr());
        }
        let import = import(data)?;
        let ptr = import.ptr();
        self.entries.insert(*data, Entry { import, users: 1 });
        tracing::trace!(?ptr, "import made");
        Ok(ptr)
    }

    /// Drop one user of `data`'s import; on the last, free it with `free`. If `free` fails the
    /// entry is gone anyway (the driver holds nothing more we could free twice).
    pub fn release_with<E: From<CacheError>>(
        &mut self,
        data: &ExportBlob,
        free: impl FnOnce(ImportedPointer<R>) -> Result<(), E>,
    ) -> Result<Released, E> {
        let Some(e) = self.entries.get_mut(data) else {
            return Err(CacheError::NotHeld(*data).into());
        };
        e.users -= 1;
        if e.users > 0 {
            return Ok(Released::StillHeld { users: e.users });
        }
        let Some(e) = self.entries.remove(data) else {
            return Err(CacheError::NotHeld(*data).into());
        };
        let ptr = e.import.ptr();
        free(e.import)?;
        Ok(Released::Freed(ptr))
    }

    /// [`acquire_with`](ImportCache::acquire_with) through a driver's `cuMemPoolImportPointer`.
    pub fn acquire(
        &mut self,
        driver: R,
        pool: PoolHandle,
        data: &ExportBlob,
    ) -> Result<DevicePtr, CacheError> {
        Ok(self.acquire_with(data, |d| ImportedPointer::import(driver, pool, d))?)
    }

    /// [`release_with`](ImportCache::release_with) through the driver's stream-ordered free.
    pub fn release(
        &mut self,
        data: &ExportBlob,
        stream: StreamHandle,
    ) -> Result<Released, CacheError> {
        self.release_with(data, |import| import.free(stream).map_err(CacheError::from))
    }

    /// Users of `data`'s import, 0 when not held.
    #[must_use]
    pub fn users(&self, data: &ExportBlob) -> u32 {
        self.entries.get(data).map_or(0, |e| e.users)
    }

    /// How many distinct imports are live.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no import is live.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Free every live import regardless of users (worker shutdown), returning how many.
    pub fn free_all(&mut self, stream: StreamHandle) -> usize {
        let mut n = 0;
        for (_, e) in self.entries.drain() {
            let ptr = e.import.ptr();
            if let Err(err) = e.import.free(stream) {
                tracing::warn!(?ptr, error = %err, "freeing an import at shutdown failed");
            }
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use poolipc_driver::{CuCode, MockDriver};

    fn blob(n: u8) -> ExportBlob {
        ExportBlob([n; 64])
    }

    #[test]
    fn the_same_export_is_imported_once() {
        let mut d = MockDriver::new();
        d.expect_mem_pool_import_pointer()
            .times(1)
            .returning(|_, _| Ok(DevicePtr(0x1000)));
        // Dropped, the cache frees what it still holds: once.
        d.expect_mem_pool_free_import()
            .times(1)
            .returning(|_, _| Ok(()));
        let mut cache = ImportCache::new();
        let a = cache.acquire(&d, PoolHandle::mock(1), &blob(1)).unwrap();
        let b = cache.acquire(&d, PoolHandle::mock(1), &blob(1)).unwrap();
        assert_eq!(a, b);
        assert_eq!(cache.users(&blob(1)), 2);
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn distinct_exports_are_distinct_imports() {
        let mut d = MockDriver::new();
        let mut next = 0x1000;
        d.expect_mem_pool_import_pointer()
            .times(2)
            .returning(move |_, _| {
                next += 0x1000;
                Ok(DevicePtr(next))
            });
        // Dropped, the cache frees what it still holds: each import once.
        d.expect_mem_pool_free_import()
            .times(2)
            .returning(|_, _| Ok(()));
        let mut cache = ImportCache::new();
        let a = cache.acquire(&d, PoolHandle::mock(1), &blob(1)).unwrap();
        let b = cache.acquire(&d, PoolHandle::mock(1), &blob(2)).unwrap();
        assert_ne!(a, b);
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn the_import_is_freed_on_the_last_release_only() {
        let mut d = MockDriver::new();
        d.expect_mem_pool_import_pointer()
            .times(1)
            .returning(|_, _| Ok(DevicePtr(0x1000)));
        // One free in all: a free at the first release would leave none for the last, and
        // mockall fails the test on a call past `times`.
        d.expect_mem_pool_free_import()
            .withf(|p, _| *p == DevicePtr(0x1000))
            .times(1)
            .returning(|_, _| Ok(()));
        let mut cache = ImportCache::new();
        cache.acquire(&d, PoolHandle::mock(1), &blob(1)).unwrap();
        cache.acquire(&d, PoolHandle::mock(1), &blob(1)).unwrap();
        assert_eq!(
            cache.release(&blob(1), StreamHandle::NULL).unwrap(),
            Released::StillHeld { users: 1 }
        );
        assert_eq!(
            cache.release(&blob(1), StreamHandle::NULL).unwrap(),
            Released::Freed(DevicePtr(0x1000))
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn after_the_last_release_a_new_acquire_imports_again() {
        let mut d = MockDriver::new();
        d.expect_mem_pool_import_pointer()
            .times(2)
            .returning(|_, _| Ok(DevicePtr(0x2000)));
        // The release's free, and the drop's of the second import.
        d.expect_mem_pool_free_import()
            .times(2)
            .returning(|_, _| Ok(()));
        let mut cache = ImportCache::new();
        cache.acquire(&d, PoolHandle::mock(1), &blob(3)).unwrap();
        cache.release(&blob(3), StreamHandle::NULL).unwrap();
        cache.acquire(&d, PoolHandle::mock(1), &blob(3)).unwrap();
        assert_eq!(cache.users(&blob(3)), 1);
    }

    #[test]
    fn releasing_what_is_not_held_is_an_error() {
        let mut cache: ImportCache<&MockDriver> = ImportCache::new();
        let e = cache.release(&blob(9), StreamHandle::NULL).unwrap_err();
        assert!(matches!(e, CacheError::NotHeld(_)), "{e}");
    }

    #[test]
    fn a_failed_import_is_not_cached() {
        let mut d = MockDriver::new();
        d.expect_mem_pool_import_pointer()
            .times(1)
            .returning(|_, _| {
                Err(DriverError::Call {
                    call: "cuMemPoolImportPointer",
                    code: CuCode::INVALID_VALUE,
                })
            });
        d.expect_mem_pool_import_pointer()
            .times(1)
            .returning(|_, _| Ok(DevicePtr(0x3000)));
        // Dropped, the cache frees the import it holds.
        d.expect_mem_pool_free_import()
            .times(1)
            .returning(|_, _| Ok(()));
        let mut cache = ImportCache::new();
        assert!(cache.acquire(&d, PoolHandle::mock(1), &blob(4)).is_err());
        assert_eq!(cache.users(&blob(4)), 0);
        assert_eq!(
            cache.acquire(&d, PoolHandle::mock(1), &blob(4)).unwrap(),
            DevicePtr(0x3000)
        );
    }

    #[test]
    fn free_all_frees_every_live_import_once() {
        let mut d = MockDriver::new();
        let mut next = 0;
        d.expect_mem_pool_import_pointer()
            .times(3)
            .returning(move |_, _| {
                next += 0x1000;
                Ok(DevicePtr(next))
            });
        d.expect_mem_pool_free_import()
            .times(3)
            .returning(|_, _| Ok(()));
        let mut cache = ImportCache::new();
        for n in 1..=3 {
            cache.acquire(&d, PoolHandle::mock(1), &blob(n)).unwrap();
            cache.acquire(&d, PoolHandle::mock(1), &blob(n)).unwrap();
        }
        assert_eq!(cache.free_all(StreamHandle::NULL), 3);
        assert!(cache.is_empty());
    }
}
