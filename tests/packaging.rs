//! The package for C and C++ hosts, as a host would use it:
//!
//! 1. `scripts/install.sh --lib <this build's libdsv4.so> PREFIX` into a fresh prefix under
//!    `CARGO_TARGET_TMPDIR`; checks the layout (real file `libdsv4.so.MAJOR.MINOR.0`, the
//!    symlinks `libdsv4.so.MAJOR` and `libdsv4.so`, headers, `dsv4.pc`, the CMake files);
//! 2. `readelf -d`: the installed library's SONAME is `libdsv4.so.<DSV4_ABI_VERSION_MAJOR>`;
//! 3. `examples/c/main.c` built with `cc ... $(pkg-config --cflags --libs dsv4)`
//!    (PKG_CONFIG_PATH=PREFIX/lib/pkgconfig), which must record `libdsv4.so.MAJOR` as NEEDED;
//! 4. the prefix moved elsewhere (the CMake package is relocatable), then `examples/` built
//!    with CMake (`find_package(dsv4 REQUIRED)`, `dsv4::dsv4`): the C and the C++ example;
//! 5. each program run with LD_LIBRARY_PATH=<prefix>/lib: its `logit0 = <v>` must equal
//!    what the Rust API computes for the same batch (within 1e-6), and its argmax too.
//!
//! Tools: bash, cc, c++, pkg-config, cmake, make or ninja, readelf. scripts/test.sh puts
//! pip's cmake, ninja and pkgconf (target/pyenv/bin) on PATH. When one is missing the test
//! prints `skipped: <tool> not found` and passes, except when the environment variable CI is
//! set: CI must have them all, so there it fails.

mod common;

use common::native::{have, library, root, run};
use std::path::Path;
use std::process::Command;

use dsv4::ffi::{DSV4_ABI_VERSION_MAJOR, DSV4_ABI_VERSION_MINOR};

/// `readelf -d` lines of `file` whose tag is `tag` (e.g. "SONAME", "NEEDED"): the names
/// in brackets.
fn dynamic_entries(file: &Path, tag: &str) -> Vec<String> {
    let out = run(
        Command::new("readelf").arg("-d").arg(file),
        &format!("readelf -d {}", file.display()),
    );
    out.lines()
        .filter(|l| l.contains(&format!("({tag})")))
        .filter_map(|l| {
            let start = l.find('[')?;
            let end = l.rfind(']')?;
            Some(l[start + 1..end].to_string())
        })
        .collect()
}

/// logits[0] and the argmax of the last row of the examples' batch through the Rust API
/// (default numerics, as the examples).
fn rust_expected() -> (f32, usize) {
    let logits = common::native::tiny_dummy_last_logits(dsv4::Numerics::Official);
    let mut best = 0;
    for (v, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = v;
        }
    }
    (logits[0], best)
}

/// The value of the example's `<key> = <value>` line.
fn printed<T: std::str::FromStr>(out: &str, key: &str) -> T {
    let prefix = format!("{key} = ");
    out.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{key} = <value>` line in:\n{out}"))
}

/// Runs an example program against `libdir` and checks its output against the Rust API.
fn check_example(name: &str, bin: &Path, libdir: &Path, expected: (f32, usize)) {
    let needed = dynamic_entries(bin, "NEEDED");
    let soname = format!("libdsv4.so.{DSV4_ABI_VERSION_MAJOR}");
    assert!(
        needed.contains(&soname),
        "{name}: NEEDED {needed:?} lacks {soname}"
    );
    let out = run(
        Command::new(bin).env("LD_LIBRARY_PATH", libdir),
        &format!("{name} ({})", bin.display()),
    );
    let logit0: f64 = printed(&out, "logit0");
    let argmax: usize = printed(&out, "argmax");
    let d = (logit0 - expected.0 as f64).abs();
    println!(
        "{name}: logit0 = {logit0:.6e} (Rust API {:.6e}, |diff| {d:.1e}), argmax = {argmax}",
        expected.0
    );
    assert!(
        d <= 1e-6,
        "{name}: logit0 {logit0} vs Rust API {}",
        expected.0
    );
    assert_eq!(argmax, expected.1, "{name}: argmax");
}

#[test]
fn install_then_build_examples_with_pkg_config_and_cmake() {
    let generator_tool = if have("ninja") { "ninja" } else { "make" };
    for tool in [
        "bash",
        "cc",
        "c++",
        "readelf",
        "pkg-config",
        "cmake",
        generator_tool,
    ] {
        if !have(tool) {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "{tool} not found, and CI is set: CI must have it (scripts/test.sh installs \
                     cmake, ninja and pkgconf into target/pyenv and puts target/pyenv/bin on PATH)"
                );
            }
            let what = if generator_tool == "make" && tool == "make" {
                "make (nor ninja)"
            } else {
                tool
            };
            println!("skipped: {what} not found");
            return;
        }
    }

    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("packaging");
    if work.exists() {
        std::fs::remove_dir_all(&work).unwrap();
    }
    std::fs::create_dir_all(&work).unwrap();
    let prefix = work.join("prefix");
    let lib = library();

    // 1. Install.
    let out = run(
        Command::new("bash")
            .arg(root().join("scripts/install.sh"))
            .arg("--lib")
            .arg(&lib)
            .arg(&prefix)
            .env_remove("DESTDIR"),
        "scripts/install.sh",
    );
    print!("{out}");
    let libdir = prefix.join("lib");
    let (major, minor) = (DSV4_ABI_VERSION_MAJOR, DSV4_ABI_VERSION_MINOR);
    let soname = format!("libdsv4.so.{major}");
    let realname = format!("libdsv4.so.{major}.{minor}.0");
    let real = libdir.join(&realname);
    let meta = std::fs::symlink_metadata(&real).expect("installed library");
    assert!(meta.is_file(), "{} must be a regular file", real.display());
    assert_eq!(
        meta.len(),
        std::fs::metadata(&lib).unwrap().len(),
        "installed library size"
    );
    for (link, target) in [
        (soname.as_str(), realname.as_str()),
        ("libdsv4.so", soname.as_str()),
    ] {
        let at = libdir.join(link);
        let got = std::fs::read_link(&at)
            .unwrap_or_else(|e| panic!("{} must be a symlink: {e}", at.display()));
        assert_eq!(got, Path::new(target), "{link} -> {target}");
    }
    for f in [
        "include/dsv4.h",
        "include/dsv4.hpp",
        "lib/pkgconfig/dsv4.pc",
        "lib/cmake/dsv4/dsv4Config.cmake",
        "lib/cmake/dsv4/dsv4ConfigVersion.cmake",
    ] {
        assert!(prefix.join(f).is_file(), "{f} not installed");
    }
    assert_eq!(
        std::fs::read(prefix.join("include/dsv4.h")).unwrap(),
        std::fs::read(root().join("include/dsv4.h")).unwrap(),
        "installed dsv4.h"
    );

    // 2. SONAME.
    let sonames = dynamic_entries(&real, "SONAME");
    assert_eq!(
        sonames,
        vec![soname.clone()],
        "SONAME of {}",
        real.display()
    );
    println!("SONAME of {realname}: {}", sonames[0]);

    let expected = rust_expected();
    let main_c = root().join("examples/c/main.c");

    // 3. pkg-config.
    let pc_path = libdir.join("pkgconfig");
    let pkg_config = |args: &[&str]| {
        run(
            Command::new("pkg-config")
                .args(args)
                .arg("dsv4")
                .env("PKG_CONFIG_PATH", &pc_path),
            &format!("pkg-config {}", args.join(" ")),
        )
    };
    let version = pkg_config(&["--modversion"]);
    assert_eq!(version.trim(), env!("CARGO_PKG_VERSION"), "dsv4.pc Version");
    let flags = pkg_config(&["--cflags", "--libs"]);
    println!("pkg-config --cflags --libs dsv4: {}", flags.trim());
    let pc_bin = work.join("example_c_pkgconfig");
    run(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror"])
            .arg(&main_c)
            .args(flags.split_whitespace())
            .arg("-o")
            .arg(&pc_bin),
        "cc examples/c/main.c $(pkg-config --cflags --libs dsv4)",
    );
    check_example("examples/c (pkg-config)", &pc_bin, &libdir, expected);

    // 4. CMake, against the prefix moved elsewhere.
    let moved = work.join("moved-prefix");
    std::fs::rename(&prefix, &moved).unwrap();
    let moved_libdir = moved.join("lib");
    let build = work.join("cmake-build");
    let warn = "-Wall -Wextra -Wpedantic -Werror";
    let mut configure = Command::new("cmake");
    configure
        .arg("-S")
        .arg(root().join("examples"))
        .arg("-B")
        .arg(&build)
        .arg(format!("-DCMAKE_PREFIX_PATH={}", moved.display()))
        .arg("-DCMAKE_BUILD_TYPE=Release")
        .arg("-DCMAKE_C_COMPILER=cc")
        .arg("-DCMAKE_CXX_COMPILER=c++")
        .arg(format!("-DCMAKE_C_FLAGS={warn}"))
        .arg(format!("-DCMAKE_CXX_FLAGS={warn}"))
        .env_remove("CMAKE_PREFIX_PATH")
        .env_remove("dsv4_DIR")
        .env_remove("dsv4_ROOT");
    if generator_tool == "ninja" {
        configure.args(["-G", "Ninja"]);
    } else {
        configure.args(["-G", "Unix Makefiles"]);
    }
    let out = run(&mut configure, "cmake (configure examples/)");
    let found = format!("from {}", moved_libdir.join("cmake/dsv4").display());
    assert!(
        out.contains(&found),
        "find_package(dsv4) did not use the moved prefix ({found}):\n{out}"
    );
    run(
        Command::new("cmake").arg("--build").arg(&build),
        "cmake --build (examples/)",
    );
    check_example(
        "examples/c (CMake)",
        &build.join("dsv4_example_c"),
        &moved_libdir,
        expected,
    );
    check_example(
        "examples/cpp (CMake, dsv4.hpp)",
        &build.join("dsv4_example_cpp"),
        &moved_libdir,
        expected,
    );
}
