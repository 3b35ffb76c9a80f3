//! A worker spawned by the parent: one end of a `socketpair`, inherited through `exec`, found
//! by the worker through [`FD_ENV`]. No path on disk, nothing another process can connect to.

use std::ffi::OsStr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::sys::resource::{Resource, getrlimit};
use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrLike, SockaddrStorage, getsockname, getsockopt,
    socketpair, sockopt,
};
use nix::sys::stat::{SFlag, fstat};

use crate::connection::Connection;
use crate::error::{SetupError, io, sys};

/// The environment variable that tells a spawned worker which descriptor is its socket: a
/// decimal number, nothing else.
pub const FD_ENV: &str = "POOLIPC_FD";

/// Spawns `cmd` as a worker connected to us: creates a socketpair, lets the child inherit one
/// end and names it in [`FD_ENV`]. Only that one: every other descriptor of this process
/// above stdio is made close-on-exec in the child before its exec, ours (all opened so) and
/// those a library opened without the flag (libcuda's exports come without it; a host
/// application's files and sockets may too): a worker runs someone else's code and gets no
/// handle of the parent's by inheritance.
///
/// Returns the child and our end. Our copy of the child's end is closed before returning, so
/// the child's death is seen as EOF.
pub fn spawn_worker(mut cmd: Command) -> Result<(Child, Connection), SetupError> {
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(sys("socketpair"))?;
    // Keep the child's end off 0..=2, which `Command` may overwrite with stdio.
    let theirs = if theirs.as_raw_fd() <= 2 {
        let raw =
            fcntl(&theirs, FcntlArg::F_DUPFD_CLOEXEC(3)).map_err(sys("fcntl(F_DUPFD_CLOEXEC)"))?;
        // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; nothing else owns it.
        unsafe { OwnedFd::from_raw_fd(raw) }
    } else {
        theirs
    };
    let raw = theirs.as_raw_fd();
    cmd.env(FD_ENV, raw.to_string());
    let last = highest_fd();
    let inherit_only_ours = move || {
        // SAFETY: fcntl on an integer descriptor has no memory-safety preconditions.
        if unsafe { libc::fcntl(raw, libc::F_SETFD, 0) } == -1 {
            return Err(std::io::Error::last_os_error());
        }
        cloexec_all_but(raw, last);
        Ok(())
    };
    // SAFETY: the closure runs in the child between fork and exec and only makes system calls
    // that are async-signal-safe (fcntl, close_range); it allocates nothing and takes no lock.
    // `raw` is open in the child because fork copied our table while `theirs` was alive (it
    // lives until after spawn).
    unsafe {
        cmd.pre_exec(inherit_only_ours);
    }
    let child = cmd.spawn().map_err(io("spawn worker"))?;
    drop(theirs);
    tracing::debug!(pid = child.id(), fd = raw, "spawned worker");
    Ok((child, Connection::new(ours)))
}

/// The highest descriptor number this process may hold (one below `RLIMIT_NOFILE`'s soft
/// limit, at most 2^20), read before the fork: the child's fallback walks up to it.
fn highest_fd() -> RawFd {
    let soft = getrlimit(Resource::RLIMIT_NOFILE).map_or(1 << 16, |(soft, _)| soft);
    RawFd::try_from(soft.clamp(4, 1 << 20)).unwrap_or(1 << 16) - 1
}

/// In the child between fork and exec: marks every descriptor from 3 up except `keep`
/// close-on-exec, so that the exec closes them. One `close_range(CLOSE_RANGE_CLOEXEC)` for
/// each side of `keep` (Linux 5.11); on an older kernel `fcntl(F_SETFD, FD_CLOEXEC)` on every
/// number up to `last` (a closed one answers EBADF, ignored). Both are async-signal-safe.
/// Nothing is closed before the exec: the pipe on which `std` reports a failed exec to the
/// parent is close-on-exec already and must stay open until then.
fn cloexec_all_but(keep: RawFd, last: RawFd) {
    for (first, end) in [(3, keep - 1), (keep + 1, RawFd::MAX)] {
        if first > end {
            continue;
        }
        // Both bounds are descriptor numbers from 3 up: they fit an unsigned int.
        let (lo, hi) = (first.unsigned_abs(), end.unsigned_abs());
        // SAFETY: close_range takes two numbers and a flag and touches no memory of ours;
        // with CLOSE_RANGE_CLOEXEC it only sets the close-on-exec flag of open descriptors.
        let r = unsafe { libc::syscall(libc::SYS_close_range, lo, hi, libc::CLOSE_RANGE_CLOEXEC) };
        if r != 0 {
            cloexec_each(first, end.min(last));
        }
    }
}

/// `close_range`'s fallback: `fcntl(F_SETFD, FD_CLOEXEC)` on every number of `first..=last`.
/// Async-signal-safe.
pub(crate) fn cloexec_each(first: RawFd, last: RawFd) {
    for fd in first..=last {
        // SAFETY: F_SETFD on any integer sets a flag or fails with EBADF; no memory is
        // touched.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

static TAKEN: AtomicBool = AtomicBool::new(false);

/// In a worker: takes the socket the parent named in [`FD_ENV`].
///
/// The variable must be a plain decimal number of an open descriptor above 2 that is a Unix
/// stream socket; anything else is a clear error. The socket is made close-on-exec again, so
/// the worker's own children do not inherit it. It can be taken once per process.
pub fn connection_from_env() -> Result<Connection, SetupError> {
    let value = std::env::var_os(FD_ENV).ok_or(SetupError::EnvMissing { var: FD_ENV })?;
    let raw = parse_fd_var(&value)?;
    if TAKEN.swap(true, Ordering::AcqRel) {
        return Err(SetupError::AlreadyTaken);
    }
    // SAFETY: fcntl(F_GETFD) on any integer is harmless; it tells whether `raw` is open.
    if unsafe { libc::fcntl(raw, libc::F_GETFD) } == -1 {
        return Err(SetupError::NotASocket {
            fd: raw,
            reason: "it is not open".into(),
        });
    }
    // SAFETY: `raw` is open (checked above) and stays open for this borrow: the parent named
    // it for us and no other code in this process owns it (the once-guard above).
    let borrowed = unsafe { BorrowedFd::borrow_raw(raw) };
    check_unix_stream(borrowed)?;
    fcntl(borrowed, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).map_err(sys("fcntl(F_SETFD)"))?;
    // SAFETY: as above: the descriptor was inherited for this purpose, is open, is a Unix
    // stream socket, and the once-guard makes this the only OwnedFd for it in the process.
    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
    Ok(Connection::new(owned))
}

fn check_unix_stream(fd: BorrowedFd<'_>) -> Result<(), SetupError> {
    let raw = fd.as_raw_fd();
    let st = fstat(fd).map_err(sys("fstat"))?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
        return Err(SetupError::NotASocket {
            fd: raw,
            reason: "not a socket".into(),
        });
    }
    let ty = getsockopt(&fd, sockopt::SockType).map_err(sys("getsockopt(SO_TYPE)"))?;
    if ty != SockType::Stream {
        return Err(SetupError::NotASocket {
            fd: raw,
            reason: format!("socket type {ty:?}, not a stream"),
        });
    }
    let addr: SockaddrStorage = getsockname(raw).map_err(sys("getsockname"))?;
    if addr.family() != Some(AddressFamily::Unix) {
        return Err(SetupError::NotASocket {
            fd: raw,
            reason: format!("address family {:?}, not Unix", addr.family()),
        });
    }
    Ok(())
}

/// Parses [`FD_ENV`]'s value strictly: ASCII digits only, no sign, no spaces, no leading zero,
/// a descriptor above 2 (0..=2 are stdio) that fits in an `int`.
pub fn parse_fd_var(value: &OsStr) -> Result<RawFd, SetupError> {
    let invalid = |reason| SetupError::EnvInvalid {
        var: FD_ENV,
        value: value.to_string_lossy().into_owned(),
        reason,
    };
    let s = value.to_str().ok_or_else(|| invalid("not UTF-8"))?;
    if s.is_empty() {
        return Err(invalid("empty"));
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid("not a plain decimal number"));
    }
    if s.len() > 1 && s.starts_with('0') {
        return Err(invalid("leading zero"));
    }
    let fd: RawFd = s
        .parse()
        .map_err(|_| invalid("too large for a file descriptor"))?;
    if fd <= 2 {
        return Err(invalid("0, 1 and 2 are stdio, not a socket"));
    }
    Ok(fd)
}
