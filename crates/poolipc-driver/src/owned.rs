//! Owned driver handles: each destroys what it holds when dropped, and a failure to do so is
//! logged, never a panic (as cudarc's `CudaEvent` does).

use std::sync::Arc;

use crate::api::Driver;
use crate::error::DriverError;
use crate::types::{EventHandle, StreamHandle};
use poolipc_types::EventBlob;

/// An event this process created or opened; destroyed on drop.
pub struct OwnedEvent {
    driver: Arc<dyn Driver>,
    handle: EventHandle,
}

impl std::fmt::Debug for OwnedEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedEvent").field(&self.handle).finish()
    }
}

impl OwnedEvent {
    /// Creates an event (`interprocess`: shareable, timing disabled).
    pub fn new(driver: Arc<dyn Driver>, interprocess: bool) -> Result<OwnedEvent, DriverError> {
        let handle = driver.event_create(interprocess)?;
        Ok(OwnedEvent { driver, handle })
    }

    /// Opens another process's interprocess event.
    pub fn open_ipc(driver: Arc<dyn Driver>, blob: &EventBlob) -> Result<OwnedEvent, DriverError> {
        let handle = driver.ipc_open_event_handle(blob)?;
        Ok(OwnedEvent { driver, handle })
    }

    /// The raw handle, valid while `self` lives.
    pub fn handle(&self) -> EventHandle {
        self.handle
    }

    /// The interprocess handle another process opens this event with.
    pub fn ipc_handle(&self) -> Result<EventBlob, DriverError> {
        self.driver.ipc_get_event_handle(self.handle)
    }
}

impl Drop for OwnedEvent {
    fn drop(&mut self) {
        if let Err(e) = self.driver.event_destroy(self.handle) {
            tracing::warn!(event = ?self.handle, error = %e, "destroying an event failed");
        }
    }
}

/// A stream this process created; destroyed on drop.
pub struct OwnedStream {
    driver: Arc<dyn Driver>,
    handle: StreamHandle,
}

impl std::fmt::Debug for OwnedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedStream").field(&self.handle).finish()
    }
}

impl OwnedStream {
    /// Creates a stream.
    pub fn new(driver: Arc<dyn Driver>) -> Result<OwnedStream, DriverError> {
        let handle = driver.stream_create()?;
        Ok(OwnedStream { driver, handle })
    }

    /// The raw handle, valid while `self` lives.
    pub fn handle(&self) -> StreamHandle {
        self.handle
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if let Err(e) = self.driver.stream_destroy(self.handle) {
            tracing::warn!(stream = ?self.handle, error = %e, "destroying a stream failed");
        }
    }
}
