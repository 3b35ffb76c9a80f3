//! Events and streams.

use std::ops::Deref;
use std::sync::Arc;

use crate::api::Driver;
use crate::error::Result;
use crate::types::{EventHandle, StreamHandle};
use poolipc_types::EventBlob;

/// An event this process created or opened; destroyed on drop.
pub struct OwnedEvent<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    handle: EventHandle,
    /// Cleared once destroyed (by `close`) or given up (by `into_raw`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for OwnedEvent<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedEvent").field(&self.handle).finish()
    }
}

impl<R: Deref<Target: Driver>> OwnedEvent<R> {
    /// Creates an event (`interprocess`: shareable, timing disabled).
    pub fn new(driver: R, interprocess: bool) -> Result<OwnedEvent<R>> {
        let handle = driver.event_create(interprocess, crate::types::OwnerToken(()))?;
        Ok(OwnedEvent {
            driver,
            handle,
            live: true,
        })
    }

    /// Opens another process's interprocess event.
    pub fn open_ipc(driver: R, blob: &EventBlob) -> Result<OwnedEvent<R>> {
        let handle = driver.ipc_open_event_handle(blob)?;
        Ok(OwnedEvent {
            driver,
            handle,
            live: true,
        })
    }

    /// The raw handle, valid while `self` lives.
    pub fn handle(&self) -> EventHandle {
        self.handle
    }

    /// The interprocess handle another process opens this event with.
    pub fn ipc_handle(&self) -> Result<EventBlob> {
        self.driver.ipc_get_event_handle(self.handle)
    }

    /// Gives the event up without destroying it: it lives until the process exits (an event
    /// a program keeps for its whole life, or one whose handle is stored where no owner fits).
    pub fn into_raw(mut self) -> EventHandle {
        self.live = false;
        self.handle
    }

    /// Destroys the event now, returning the driver's error.
    pub fn close(mut self) -> Result<()> {
        self.live = false;
        // SAFETY: made by `event_create`/`ipc_open_event_handle` of this driver, destroyed
        // only here or in Drop (`live` is now false), and `self` is gone after this.
        unsafe { self.driver.event_destroy(self.handle) }
    }
}

impl<R: Deref<Target: Driver>> Drop for OwnedEvent<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `close`, which did not run (`live`).
            let r = unsafe { self.driver.event_destroy(self.handle) };
            super::warn_failed("an event", self.handle, r);
        }
    }
}

/// A stream this process created; destroyed on drop.
pub struct OwnedStream<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    handle: StreamHandle,
    /// Cleared once destroyed (by `close`) or given up (by `into_raw`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for OwnedStream<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedStream").field(&self.handle).finish()
    }
}

impl<R: Deref<Target: Driver>> OwnedStream<R> {
    /// Creates a stream (`cuStreamCreate`, non-blocking).
    pub fn new(driver: R) -> Result<OwnedStream<R>> {
        let handle = driver.stream_create(crate::types::OwnerToken(()))?;
        Ok(OwnedStream {
            driver,
            handle,
            live: true,
        })
    }

    /// The raw handle, valid while `self` lives.
    pub fn handle(&self) -> StreamHandle {
        self.handle
    }

    /// Gives the stream up without destroying it: it lives until the process exits (a stream
    /// a program keeps for its whole life, or one whose handle is stored where no owner fits).
    pub fn into_raw(mut self) -> StreamHandle {
        self.live = false;
        self.handle
    }

    /// Destroys the stream now, returning the driver's error (work queued on it still runs).
    pub fn close(mut self) -> Result<()> {
        self.live = false;
        // SAFETY: made by `stream_create` of this driver, destroyed only here or in Drop
        // (`live` is now false), and `self` is gone after this.
        unsafe { self.driver.stream_destroy(self.handle) }
    }
}

impl<R: Deref<Target: Driver>> Drop for OwnedStream<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `close`, which did not run (`live`).
            let r = unsafe { self.driver.stream_destroy(self.handle) };
            super::warn_failed("a stream", self.handle, r);
        }
    }
}
