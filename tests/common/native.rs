//! Building and running native (C/C++) programs against this build's library: where
//! `libdsv4.so` is, whether a tool exists, running a command.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// This build's `libdsv4.so`. `cargo test` builds the cdylib next to the test binary
/// (target/<profile>/deps/, from the same rustc run as the rlib this test links, so never
/// stale); `cargo build` puts it in target/<profile>/. Last resort: `DSV4_LIBRARY`.
pub fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let profile = deps.parent().expect("target/<profile>");
    for dir in [deps, profile] {
        let lib = dir.join("libdsv4.so");
        if lib.is_file() {
            return lib;
        }
    }
    if let Some(lib) = std::env::var_os("DSV4_LIBRARY").map(PathBuf::from)
        && lib.is_file()
    {
        return lib;
    }
    panic!(
        "libdsv4.so not found in {} or {} (cargo build builds it)",
        deps.display(),
        profile.display()
    );
}

/// Whether `tool --version` runs.
pub fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs a command, panicking with its output on failure; returns stdout.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
}

/// The last-row logits of the native programs' batch (tokens 1, 2, 3, 4 at positions 0..=3
/// in slot 0) on the embedded tiny model with dummy weights, through the Rust API, with the
/// programs' numerics (their capacities do not change the logits).
pub fn tiny_dummy_last_logits(numerics: dsv4::Numerics) -> Vec<f32> {
    use dsv4::{Batch, ConfigSource, Engine, EngineOptions, LogitsOut};
    let opts = EngineOptions {
        max_num_seqs: 1,
        max_num_tokens: 16,
        max_seq_len: 64,
        num_threads: 2,
        numerics,
        ..EngineOptions::default()
    };
    let mut e = Engine::create(ConfigSource::TinyDefault, opts).expect("create");
    e.load(None, dsv4::LoadFormat::Dummy).expect("dummy load");
    e.finalize().expect("finalize");
    let mut logits = vec![0.0f32; e.config().vocab_size];
    let mut b = Batch {
        token_ids: &[1, 2, 3, 4],
        positions: &[0, 1, 2, 3],
        seq_slots: &[0],
        query_start: &[0, 4],
        logits_rows: Some(&[3]),
        logits: LogitsOut::F32(&mut logits),
    };
    e.forward(&mut b).expect("forward");
    logits
}
