//! Helpers shared by this crate's two-process tests.
#![allow(dead_code)] // each test binary uses what it needs

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// Sends one descriptor (with one byte) by SCM_RIGHTS.
pub(crate) fn send_fd(sock: &UnixStream, fd: &impl AsRawFd) {
    let fds = [fd.as_raw_fd()];
    sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(b"F")],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
}

/// Receives one descriptor sent by [`send_fd`], close-on-exec.
pub(crate) fn recv_fd(sock: &UnixStream) -> OwnedFd {
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .unwrap();
    for c in msg.cmsgs().unwrap() {
        if let ControlMessageOwned::ScmRights(fds) = c {
            // SAFETY: the kernel just installed this descriptor in our table; nothing else
            // owns it.
            return unsafe { OwnedFd::from_raw_fd(fds[0]) };
        }
    }
    panic!("no descriptor arrived");
}
