//! Compiles the programs of `tests/c/` against `include/dsv4.h` and this build's cdylib,
//! then runs them:
//!
//! - `abi_smoke.c` as C11 (`gcc -std=c11 -Wall -Wextra -Wpedantic -Werror`) and the same
//!   file as C++17 (`g++ -std=c++17 -x c++ ...`);
//! - `cpp_wrapper.cpp` and `cpp_refit_guard.cpp` (bindings/cpp/dsv4.hpp) as C++17, each
//!   with and without `DSV4_HPP_EXCEPTIONS`. `cpp_refit_guard` runs a serving / RL flow:
//!   weight queries, prefill + greedy decode into a reused logits buffer, the log callback,
//!   chunked refits through `dsv4::RefitSession` left by an exception or an early return
//!   (engine READY, the chunk written before the failure applied), a complete refit.
//!
//! Each program runs on the embedded tiny model with dummy weights and on the committed
//! checkpoint fixture `tests/fixtures/tiny`. `abi_smoke` (with `DSV4_NUMERICS_EXACT`) checks
//! logits[last row][0] of its prompt:
//!
//! - on the fixture, the prompt is the oracle's `prompt.0` and the expected value is the
//!   transformers oracle's `logits.0` at that row and column (oracle.safetensors, read here
//!   with the `safetensors` crate), tolerance 1e-3 (DESIGN.md §4);
//! - with dummy weights (no oracle exists), it must equal what the Rust API computes for
//!   the same batch within 1e-6 (the C path adds nothing numerically).
//!
//! The library's SONAME is `libdsv4.so.<ABI major>` (build.rs), so a program linked with
//! `-ldsv4` loads `libdsv4.so.1`, a name cargo does not create: the programs link against
//! a directory of this test (`link_dir`) holding both names as symlinks to the build's
//! library, and carry it as their rpath.
//!
//! Says "skipped: no C compiler" only when gcc is absent.

mod common;

use common::native::{have, library, root, run};
use std::path::{Path, PathBuf};
use std::process::Command;

use dsv4::Numerics;
use safetensors::{Dtype, SafeTensors};

/// Directory holding this build's `libdsv4.so` (common::native::library).
fn library_dir() -> PathBuf {
    library()
        .parent()
        .expect("the library's directory")
        .to_path_buf()
}

/// `dir` (created) with `libdsv4.so` (for `-ldsv4`) and `libdsv4.so.<ABI major>` (the
/// SONAME, what the linked programs load) as symlinks to `lib_dir/libdsv4.so`.
fn link_dir(lib_dir: &Path, dir: &Path) -> PathBuf {
    let lib = lib_dir.join("libdsv4.so");
    std::fs::create_dir_all(dir).unwrap();
    let soname = format!("libdsv4.so.{}", dsv4::ffi::DSV4_ABI_VERSION_MAJOR);
    for name in ["libdsv4.so", soname.as_str()] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link)
            .unwrap_or_else(|e| panic!("symlink {} -> {}: {e}", link.display(), lib.display()));
    }
    dir.to_path_buf()
}

fn compile(compiler: &str, args: &[&str], output: &Path, lib_dir: &Path) {
    let mut cmd = Command::new(compiler);
    cmd.args(args)
        .arg("-I")
        .arg(root().join("include"))
        .arg("-I")
        .arg(root().join("bindings/cpp"))
        .arg("-o")
        .arg(output)
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-ldsv4")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lm");
    run(&mut cmd, &format!("{compiler} {}", args.join(" ")));
}

/// logits[3][0] of abi_smoke's default prompt through the Rust API (exact numerics, as the
/// program).
fn rust_dummy_logit0() -> f32 {
    common::native::tiny_dummy_last_logits(Numerics::Exact)[0]
}

/// The transformers oracle of `tests/fixtures/<fixture>`: `prompt.0` and `logits.0` at its
/// last row, column 0 (what abi_smoke checks).
fn oracle_prompt0_last_logit0(fixture: &str) -> (Vec<i32>, f32) {
    let path = root()
        .join("tests/fixtures")
        .join(fixture)
        .join("oracle.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("oracle.safetensors");
    let prompt = st.tensor("prompt.0").expect("prompt.0");
    assert_eq!(prompt.dtype(), Dtype::I32);
    let prompt: Vec<i32> = prompt
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let logits = st.tensor("logits.0").expect("logits.0");
    assert_eq!(logits.dtype(), Dtype::F32);
    assert_eq!(logits.shape()[0], prompt.len(), "logits.0 rows");
    let vocab = logits.shape()[1];
    let (row, col) = (prompt.len() - 1, 0);
    let at = (row * vocab + col) * 4;
    let v = f32::from_le_bytes(logits.data()[at..at + 4].try_into().unwrap());
    (prompt, v)
}

/// The value abi_smoke printed as "logit0 = <v>".
fn printed_logit0(out: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix("logit0 = "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `logit0 = <value>` line in:\n{out}"))
}

#[test]
fn c_and_cpp_programs_compile_and_run() {
    if !have("gcc") {
        println!("skipped: no C compiler (gcc not found)");
        return;
    }
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_programs");
    std::fs::create_dir_all(&out_dir).unwrap();
    let lib_dir = link_dir(&library_dir(), &out_dir.join("lib"));
    let smoke = root().join("tests/c/abi_smoke.c");
    let smoke = smoke.to_str().unwrap();
    let strict = ["-Wall", "-Wextra", "-Wpedantic", "-Werror"];

    let mut programs: Vec<(String, PathBuf)> = Vec::new();
    let c_bin = out_dir.join("abi_smoke_c11");
    compile(
        "gcc",
        &[&["-std=c11"], &strict[..], &[smoke]].concat(),
        &c_bin,
        &lib_dir,
    );
    programs.push(("abi_smoke (C11)".into(), c_bin));
    if have("g++") {
        let cpp_bin = out_dir.join("abi_smoke_cpp17");
        compile(
            "g++",
            &[
                &["-std=c++17"],
                &strict[..],
                &["-x", "c++", smoke, "-x", "none"],
            ]
            .concat(),
            &cpp_bin,
            &lib_dir,
        );
        programs.push(("abi_smoke (C++17)".into(), cpp_bin));
        for program in ["cpp_wrapper", "cpp_refit_guard"] {
            let source = root().join(format!("tests/c/{program}.cpp"));
            for (tag, extra) in [
                ("status", None),
                ("exceptions", Some("-DDSV4_HPP_EXCEPTIONS")),
            ] {
                let bin = out_dir.join(format!("{program}_{tag}"));
                let mut args = vec!["-std=c++17"];
                args.extend(strict);
                args.extend(extra);
                args.push(source.to_str().unwrap());
                compile("g++", &args, &bin, &lib_dir);
                programs.push((format!("{program} ({tag})"), bin));
            }
        }
    } else {
        println!("skipped: no C++ compiler (g++ not found); C11 only");
    }

    for (config, load) in [
        ("tiny", "dummy"),
        ("tests/fixtures/tiny", "tests/fixtures/tiny"),
    ] {
        // (expected logit, tolerance, prompt argument, where the expected value comes from)
        let (expected, tol, prompt, source) = if load == "dummy" {
            (rust_dummy_logit0(), 1e-6, None, "Rust API")
        } else {
            let (prompt, v) = oracle_prompt0_last_logit0("tiny");
            let text: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
            (
                v,
                1e-3,
                Some(text.join(",")),
                "transformers oracle logits.0",
            )
        };
        let (cfg_arg, load_arg) = if config == "tiny" {
            (config.to_string(), load.to_string())
        } else {
            (
                root().join(config).display().to_string(),
                root().join(load).display().to_string(),
            )
        };
        for (name, bin) in &programs {
            let mut cmd = Command::new(bin);
            cmd.arg(&cfg_arg).arg(&load_arg);
            let smoke = name.starts_with("abi_smoke");
            if smoke {
                cmd.arg(format!("{expected:.9e}")).arg(format!("{tol:e}"));
                if let Some(p) = &prompt {
                    cmd.arg(p);
                }
            }
            let out = run(&mut cmd, &format!("{name} {cfg_arg} {load_arg}"));
            assert!(out.contains(": OK"), "{name}: {out}");
            if smoke {
                assert!(out.contains("numerics: exact"), "{name}: {out}");
                let got = printed_logit0(&out);
                let d = (got - expected as f64).abs();
                println!(
                    "{name} [{config}, {load}]: logit0 = {got:.6e}, expected {expected:.6e} ({source}), |diff| = {d:.3e} (tol {tol:e})"
                );
                assert!(
                    d <= tol,
                    "{name}: logit0 {got} vs {expected} ({source}): {d} > {tol}"
                );
            } else {
                println!(
                    "{name} [{config}, {load}]: {}",
                    out.lines()
                        .filter(|l| l.starts_with("logit0") || l.starts_with("greedy tokens"))
                        .collect::<Vec<_>>()
                        .join("; ")
                );
            }
        }
    }
}
