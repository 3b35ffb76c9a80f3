//! For workers started by someone else: a listening socket in a private directory, with the
//! peer's uid checked on every connection.
//!
//! Two walls: the directory is mode 0700 and ours, so no other user can reach the socket; and
//! `SO_PEERCRED` is checked on accept (and by the connecting side, on the listener), so a
//! connection from another uid is dropped even if the first wall was opened.
//!
//! # Why not an abstract-namespace socket
//!
//! Linux abstract sockets (`\0name`) have no file-system permissions: any process in the same
//! network namespace, of any user, can connect to one, and any process can bind the name
//! first and pose as the parent (handing the worker a pool FD of its choosing). Only the peer
//! check would stand between us and that. A path in a 0700 directory is refused by the kernel
//! before our code runs, so we use that and never the abstract namespace.

use std::fs::{self, DirBuilder};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::PollFlags;
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept4, bind, connect, getsockopt,
    listen, setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;
use nix::unistd::geteuid;

use crate::connection::{Connection, TransportError, wait};
use crate::error::{SetupError, io, sys};

/// Who is on the other end of a Unix socket, as the kernel recorded it at connect (or listen)
/// time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

impl PeerCred {
    /// Reads `SO_PEERCRED` of a connected Unix socket.
    pub fn of(sock: &impl AsFd) -> Result<Self, SetupError> {
        let c =
            getsockopt(sock, sockopt::PeerCredentials).map_err(sys("getsockopt(SO_PEERCRED)"))?;
        Ok(Self {
            pid: c.pid(),
            uid: c.uid(),
            gid: c.gid(),
        })
    }
}

/// The uid comparison both sides make: `peer` must run as `expected`.
pub fn check_peer_uid(peer: PeerCred, expected: u32) -> Result<(), SetupError> {
    if peer.uid != expected {
        return Err(SetupError::PeerUidMismatch {
            expected,
            found: peer.uid,
            pid: peer.pid,
        });
    }
    Ok(())
}

/// Makes sure `dir` is a directory private to us: creates it with mode 0700 if missing (its
/// parent must exist); if present, it must be a real directory (not a symlink), owned by our
/// effective uid, with no group or other permission bits.
pub fn ensure_private_dir(dir: &Path) -> Result<(), SetupError> {
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("create socket directory")(e)),
    }
    let insecure = |reason: String| SetupError::InsecureDir {
        path: dir.to_owned(),
        reason,
    };
    let meta = fs::symlink_metadata(dir).map_err(io("stat socket directory"))?;
    if !meta.file_type().is_dir() {
        return Err(insecure("not a directory (or a symlink)".into()));
    }
    let me = geteuid().as_raw();
    if meta.uid() != me {
        return Err(insecure(format!("owned by uid {}, not {me}", meta.uid())));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(insecure(format!(
            "mode {mode:04o} lets group or others in (0700 expected)"
        )));
    }
    Ok(())
}

/// A listening Unix socket in a private directory. The socket file is removed on drop.
///
/// Two walls keep other users out: the directory is mode 0700 and ours
/// ([`ensure_private_dir`]), so the kernel refuses their `connect` before our code runs; and
/// every accepted peer's `SO_PEERCRED` uid is checked, so a connection from another uid is
/// dropped even if the first wall was opened. [`connect_private`] checks the listener's uid
/// the same way.
///
/// # Why not an abstract-namespace socket
///
/// Linux abstract sockets (`\0name`) have no file-system permissions: any process in the same
/// network namespace, of any user, can connect to one, and any process can bind the name
/// first and pose as the parent (handing the worker a pool FD of its choosing). Only the peer
/// check would stand between us and that, so poolipc never uses the abstract namespace.
#[derive(Debug)]
pub struct PrivateListener {
    sock: OwnedFd,
    path: PathBuf,
    allowed_uid: u32,
}

impl PrivateListener {
    /// Binds `dir/name`, after [`ensure_private_dir`]. A stale socket at that path is replaced;
    /// anything else there is an error. Accepts peers of our own effective uid only.
    pub fn bind(dir: &Path, name: &str) -> Result<Self, SetupError> {
        ensure_private_dir(dir)?;
        let path = dir.join(name);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_socket() => {
                fs::remove_file(&path).map_err(io("remove stale socket"))?;
            }
            Ok(_) => return Err(SetupError::PathOccupied { path }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("stat socket path")(e)),
        }
        let addr = UnixAddr::new(&path).map_err(sys("socket path"))?;
        // Non-blocking, so `accept` can try first and poll with the deadline after.
        let sock = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )
        .map_err(sys("socket"))?;
        bind(sock.as_raw_fd(), &addr).map_err(sys("bind"))?;
        // The directory already keeps others out; the socket's own mode says the same.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
            .map_err(io("chmod socket"))?;
        listen(&sock, Backlog::new(16).map_err(sys("listen backlog"))?).map_err(sys("listen"))?;
        tracing::debug!(path = %path.display(), "listening");
        Ok(Self {
            sock,
            path,
            allowed_uid: geteuid().as_raw(),
        })
    }

    /// The socket's path, to hand to the worker.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts peers of `uid` instead of our effective uid. Meant for tests of the check and
    /// for setups where the worker deliberately runs as another user.
    pub fn set_allowed_uid(&mut self, uid: u32) {
        self.allowed_uid = uid;
    }

    /// Accepts one connection by `deadline` and checks the peer's uid. A peer of another uid
    /// is disconnected and reported as [`SetupError::PeerUidMismatch`].
    pub fn accept(&self, deadline: Instant) -> Result<(Connection, PeerCred), SetupError> {
        loop {
            match accept4(&self.sock, SockFlag::SOCK_CLOEXEC) {
                Ok(conn) => {
                    let peer = PeerCred::of(&conn)?;
                    // On mismatch `conn` drops here: the connection is closed.
                    check_peer_uid(peer, self.allowed_uid)?;
                    tracing::debug!(?peer, "accepted");
                    return Ok((Connection::new(conn), peer));
                }
                Err(Errno::EINTR | Errno::ECONNABORTED) => continue,
                Err(Errno::EAGAIN) => wait_accept(&self.sock, deadline)?,
                Err(errno) => {
                    return Err(SetupError::Sys {
                        op: "accept4",
                        errno,
                    });
                }
            }
        }
    }
}

fn wait_accept(sock: &OwnedFd, deadline: Instant) -> Result<(), SetupError> {
    match wait(sock.as_fd(), PollFlags::POLLIN, deadline) {
        Ok(()) => Ok(()),
        Err(TransportError::Timeout { .. }) => Err(SetupError::Timeout { op: "accept" }),
        Err(TransportError::Io { op, errno }) => Err(SetupError::Sys { op, errno }),
        Err(_) => Err(SetupError::Timeout { op: "accept" }),
    }
}

impl Drop for PrivateListener {
    fn drop(&mut self) {
        // Best effort: a socket file left behind is replaced by the next bind.
        let _ = fs::remove_file(&self.path);
    }
}

/// Connects to a [`PrivateListener`] at `path` by `deadline`, and checks that the listener
/// runs as our effective uid.
pub fn connect_private(path: &Path, deadline: Instant) -> Result<Connection, SetupError> {
    let addr = UnixAddr::new(path).map_err(sys("socket path"))?;
    let sock = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(sys("socket"))?;
    // A Unix connect blocks only while the listener's backlog is full; SO_SNDTIMEO bounds it.
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(SetupError::Timeout { op: "connect" });
    }
    let left = left.max(Duration::from_millis(1));
    setsockopt(
        &sock,
        sockopt::SendTimeout,
        &TimeVal::from(libc::timeval {
            tv_sec: left.as_secs().try_into().unwrap_or(libc::time_t::MAX),
            tv_usec: left.subsec_micros().into(),
        }),
    )
    .map_err(sys("setsockopt(SO_SNDTIMEO)"))?;
    loop {
        match connect(sock.as_raw_fd(), &addr) {
            Ok(()) => break,
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN | Errno::ETIMEDOUT) => {
                return Err(SetupError::Timeout { op: "connect" });
            }
            Err(errno) => {
                return Err(SetupError::Sys {
                    op: "connect",
                    errno,
                });
            }
        }
    }
    setsockopt(
        &sock,
        sockopt::SendTimeout,
        &TimeVal::from(libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        }),
    )
    .map_err(sys("setsockopt(SO_SNDTIMEO)"))?;
    let peer = PeerCred::of(&sock)?;
    check_peer_uid(peer, geteuid().as_raw())?;
    Ok(Connection::new(sock))
}
