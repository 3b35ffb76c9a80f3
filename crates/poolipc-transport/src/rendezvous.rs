//! A rendezvous for processes that did not start each other: a Unix socket in the abstract
//! namespace (no file to leave behind), a same-uid check on every peer (`SO_PEERCRED`), and
//! one message that carries a descriptor (`SCM_RIGHTS`). No ptrace rights, no `pidfd_getfd`.
//!
//! Blocking `std` sockets; waiting for a descriptor has a deadline.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::PollFlags;

use crate::connection::TransportError;
use crate::listener::{PeerCred, check_peer_uid};
use crate::scm;

/// A listening socket at an abstract-namespace name, accepting only peers of our own
/// effective uid.
#[derive(Debug)]
pub struct AbstractListener {
    inner: UnixListener,
    name: String,
}

impl AbstractListener {
    /// Binds `name` in the abstract namespace (it vanishes with the socket).
    pub fn bind(name: &str) -> io::Result<AbstractListener> {
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let inner = UnixListener::bind_addr(&addr)?;
        Ok(AbstractListener {
            inner,
            name: name.to_owned(),
        })
    }

    /// The name it is bound at.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The next peer that runs as our effective uid. A peer of another uid is refused (its
    /// connection closed, a warning logged) and the wait goes on.
    pub fn accept(&self) -> io::Result<(UnixStream, PeerCred)> {
        let me = nix::unistd::geteuid().as_raw();
        loop {
            let (stream, _) = self.inner.accept()?;
            let peer = PeerCred::of(&stream).map_err(io::Error::other)?;
            match check_peer_uid(peer, me) {
                Ok(()) => return Ok((stream, peer)),
                Err(e) => tracing::warn!(error = %e, "rendezvous: peer refused"),
            }
        }
    }
}

/// Connects to an abstract-namespace `name` and checks that the listener runs as our
/// effective uid (the check goes both ways).
pub fn connect_abstract(name: &str) -> io::Result<UnixStream> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let stream = UnixStream::connect_addr(&addr)?;
    let peer = PeerCred::of(&stream).map_err(io::Error::other)?;
    check_peer_uid(peer, nix::unistd::geteuid().as_raw()).map_err(io::Error::other)?;
    Ok(stream)
}

fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// The transport's own wait ([`crate::connection::wait`]), its errors as `io::Error`s.
fn wait_for(sock: BorrowedFd<'_>, flags: PollFlags, deadline: Instant) -> io::Result<()> {
    match crate::connection::wait(sock, flags, deadline) {
        Ok(()) => Ok(()),
        Err(TransportError::Timeout { .. }) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "rendezvous: the peer did not answer in time",
        )),
        Err(TransportError::Io { errno: e, .. }) => Err(errno(e)),
        Err(e) => Err(io::Error::other(e)),
    }
}

/// Sends all of `data` with `fd` attached to its first byte.
pub fn send_with_fd(
    sock: &UnixStream,
    data: &[u8],
    fd: Option<BorrowedFd<'_>>,
    timeout: Duration,
) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    let mut sent = 0;
    while sent < data.len() {
        match scm::send(sock.as_fd(), &data[sent..], &fds) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                sent += n;
                fds.clear();
            }
            Err(Errno::EAGAIN) => wait_for(sock.as_fd(), PollFlags::POLLOUT, deadline)?,
            Err(e) => return Err(errno(e)),
        }
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes, and the descriptor that came with them if one did
/// (more than one is an error; all are closed). End of stream before the first byte is
/// `UnexpectedEof`.
pub fn recv_with_fd(
    sock: &UnixStream,
    buf: &mut [u8],
    timeout: Duration,
) -> io::Result<Option<OwnedFd>> {
    let deadline = Instant::now() + timeout;
    let mut got = 0;
    let mut fd: Option<OwnedFd> = None;
    while got < buf.len() {
        match scm::recv(sock.as_fd(), &mut buf[got..]) {
            Ok(r) => {
                if r.truncated || r.fds.len() + usize::from(fd.is_some()) > 1 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "rendezvous: the peer sent more than one descriptor",
                    ));
                }
                if let Some(f) = r.fds.into_iter().next() {
                    fd = Some(f);
                }
                if r.bytes == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                got += r.bytes;
            }
            Err(Errno::EAGAIN) => wait_for(sock.as_fd(), PollFlags::POLLIN, deadline)?,
            Err(e) => return Err(errno(e)),
        }
    }
    Ok(fd)
}

/// Writes all of `data` (no descriptor), blocking.
pub fn send_all(mut sock: &UnixStream, data: &[u8]) -> io::Result<()> {
    sock.write_all(data)
}

/// Reads exactly `buf.len()` bytes, blocking; `Ok(false)` when the peer closed before the
/// first byte.
pub fn recv_exact(mut sock: &UnixStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match sock.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_crosses_an_abstract_socket_and_bytes_follow() {
        let name = format!("poolipc-test-rdv-{}", std::process::id());
        let l = AbstractListener::bind(&name).expect("bind");
        assert_eq!(l.name(), name);
        let t = std::thread::spawn(move || {
            let (s, peer) = l.accept().expect("accept");
            assert_eq!(peer.uid, nix::unistd::geteuid().as_raw());
            let f = std::fs::File::open("/dev/null").expect("open");
            send_with_fd(&s, b"P", Some(f.as_fd()), Duration::from_secs(5)).expect("send");
            let mut b = [0u8; 3];
            assert!(recv_exact(&s, &mut b).expect("read"));
            assert_eq!(&b, b"abc");
            assert!(!recv_exact(&s, &mut b).expect("eof"), "peer closed");
        });
        let c = connect_abstract(&name).expect("connect");
        let mut b = [0u8; 1];
        let fd = recv_with_fd(&c, &mut b, Duration::from_secs(5)).expect("recv");
        assert_eq!(&b, b"P");
        assert!(fd.is_some(), "the descriptor came");
        send_all(&c, b"abc").expect("write");
        drop(c);
        t.join().expect("server thread");
    }

    #[test]
    fn no_listener_is_a_clear_error() {
        let e = connect_abstract("poolipc-test-rdv-nobody-listens").expect_err("nobody");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    }
}
