//! Errors of setting up a connection: spawning, inheriting, listening, accepting.

use std::io;
use std::path::PathBuf;

use nix::errno::Errno;

/// Why a connection could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The worker was not given a socket: the variable is not set.
    #[error("{var} is not set: this process was not started as a poolipc worker")]
    EnvMissing {
        /// The variable ([`crate::FD_ENV`]).
        var: &'static str,
    },
    /// The variable is set but does not name a usable descriptor.
    #[error("{var}={value:?} is invalid: {reason}")]
    EnvInvalid {
        /// The variable.
        var: &'static str,
        /// Its value, lossily decoded.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The named descriptor is not a connected Unix stream socket.
    #[error("fd {fd} is not a Unix stream socket: {reason}")]
    NotASocket {
        /// The descriptor.
        fd: i32,
        /// What it is instead.
        reason: String,
    },
    /// The inherited socket was already taken by this process.
    #[error("the inherited worker socket was already taken")]
    AlreadyTaken,
    /// The socket directory is not private to us.
    #[error("socket directory {path} is not private: {reason}")]
    InsecureDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Something other than a socket sits where the socket should be created.
    #[error("{path} exists and is not a socket")]
    PathOccupied {
        /// The path.
        path: PathBuf,
    },
    /// The peer runs as another user; the connection was closed.
    #[error(
        "peer (pid {pid}) runs as uid {found}, only uid {expected} is accepted; connection dropped"
    )]
    PeerUidMismatch {
        /// The uid accepted.
        expected: u32,
        /// The peer's uid.
        found: u32,
        /// The peer's pid, as the kernel recorded it at connect time.
        pid: i32,
    },
    /// The deadline passed.
    #[error("{op}: deadline passed")]
    Timeout {
        /// What was waited for.
        op: &'static str,
    },
    /// A system call failed.
    #[error("{op} failed: {errno}")]
    Sys {
        /// The call.
        op: &'static str,
        /// What the kernel said.
        errno: Errno,
    },
    /// A file-system or process operation failed.
    #[error("{op} failed: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The error.
        source: io::Error,
    },
}

pub(crate) fn sys(op: &'static str) -> impl FnOnce(Errno) -> SetupError {
    move |errno| SetupError::Sys { op, errno }
}

pub(crate) fn io(op: &'static str) -> impl FnOnce(io::Error) -> SetupError {
    move |source| SetupError::Io { op, source }
}
