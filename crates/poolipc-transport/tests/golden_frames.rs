//! The wire format is pinned by files: `fixtures/frames/<name>.bin` holds the encoding of
//! `common::samples()`'s message of that name. A change to the codec that changes a byte
//! fails here.
//!
//! To regenerate the files on purpose (after bumping `PROTOCOL_VERSION`, or adding a kind):
//!
//! ```sh
//! POOLIPC_BLESS_FRAMES=1 cargo nextest run -p poolipc-transport --test golden_frames
//! ```
//!
//! and commit the new files with the change that explains them.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use poolipc_transport::codec::{decode, encode};
use poolipc_transport::{FrameLimits, MessageKind};

const BLESS_ENV: &str = "POOLIPC_BLESS_FRAMES";

fn frames_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/frames")
}

fn blessing() -> bool {
    std::env::var_os(BLESS_ENV).is_some_and(|v| v == "1")
}

#[test]
fn every_message_kind_has_a_golden_frame() {
    let kinds: BTreeSet<u8> = common::samples()
        .iter()
        .map(|(_, m)| m.kind() as u8)
        .collect();
    let all: BTreeSet<u8> = MessageKind::ALL.iter().map(|k| *k as u8).collect();
    assert_eq!(kinds, all, "a message kind has no sample in tests/common");
}

#[test]
fn golden_frames_match_the_encoder_byte_for_byte() {
    let dir = frames_dir();
    let mut failures = Vec::new();
    for (name, msg) in common::samples() {
        let path = dir.join(format!("{name}.bin"));
        let bytes = encode(&msg, FrameLimits::default()).expect("sample encodes");
        if blessing() {
            std::fs::write(&path, &bytes).expect("write golden frame");
            continue;
        }
        match std::fs::read(&path) {
            Ok(golden) if golden == bytes => {}
            Ok(golden) => failures.push(format!(
                "{name}: encoder gives {} bytes that differ from {} ({} bytes); \
                 if the change is deliberate, bump PROTOCOL_VERSION and rerun with {BLESS_ENV}=1",
                bytes.len(),
                path.display(),
                golden.len()
            )),
            Err(e) => failures.push(format!("{name}: cannot read {}: {e}", path.display())),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn golden_frames_decode_to_their_samples() {
    if blessing() {
        return; // the files are being rewritten by the test above
    }
    for (name, msg) in common::samples() {
        let path = frames_dir().join(format!("{name}.bin"));
        let golden = std::fs::read(&path).expect("golden frame exists");
        let decoded =
            decode(&golden, FrameLimits::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(decoded, msg, "{name}");
    }
}

#[test]
fn no_stray_golden_frames() {
    let names: BTreeSet<String> = common::samples()
        .iter()
        .map(|(n, _)| format!("{n}.bin"))
        .collect();
    for entry in std::fs::read_dir(frames_dir()).expect("fixtures/frames exists") {
        let name = entry
            .expect("dir entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".bin") {
            assert!(
                names.contains(&name),
                "{name} has no sample: remove it or add one"
            );
        }
    }
}
