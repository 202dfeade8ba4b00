//! Build script: regenerates the C header `include/dsv4.h` from `src/ffi` with cbindgen.
//!
//! The header is committed. A failure to generate it never fails the build (a
//! `cargo:warning` says why), and `tests/header_drift.rs` is what fails CI when the
//! committed header differs from a fresh generation. To keep that check meaningful the
//! script does not overwrite the committed header when `CI` or `DSV4_NO_HEADER_WRITE` is
//! set; it always writes a copy to `$OUT_DIR/dsv4.h`.
//!
//! On Linux it also gives the cdylib the SONAME `libdsv4.so.<ABI major>`, the major read
//! from `DSV4_ABI_VERSION_MAJOR` in `src/ffi/engine_api.rs` (its only definition), so a host
//! linked with `-ldsv4` asks for `libdsv4.so.1` at run time (scripts/install.sh makes the
//! links; tests/packaging.rs checks it).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CI");
    println!("cargo:rerun-if-env-changed=DSV4_NO_HEADER_WRITE");

    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        let major = abi_major(&root);
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libdsv4.so.{major}");
    }
    let text = match generate(&root) {
        Ok(t) => t,
        Err(e) => {
            println!("cargo:warning=dsv4: include/dsv4.h not regenerated: {e}");
            return;
        }
    };
    if let Ok(out) = std::env::var("OUT_DIR") {
        let _ = std::fs::write(PathBuf::from(out).join("dsv4.h"), &text);
    }
    if std::env::var_os("CI").is_some() || std::env::var_os("DSV4_NO_HEADER_WRITE").is_some() {
        return;
    }
    let header = root.join("include").join("dsv4.h");
    // Write only on change, so an unchanged header keeps its mtime.
    if std::fs::read_to_string(&header).ok().as_deref() == Some(text.as_str()) {
        return;
    }
    let written = std::fs::create_dir_all(header.parent().unwrap())
        .and_then(|_| std::fs::write(&header, &text));
    if let Err(e) = written {
        println!("cargo:warning=dsv4: cannot write {}: {e}", header.display());
    }
}

/// `DSV4_ABI_VERSION_MAJOR` as defined in `src/ffi/engine_api.rs`
/// (`pub const DSV4_ABI_VERSION_MAJOR: u32 = N;`). Panics if it cannot be found: a library
/// without its versioned SONAME must not be built silently.
fn abi_major(root: &std::path::Path) -> u32 {
    let path = root.join("src").join("ffi").join("engine_api.rs");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("dsv4 build.rs: cannot read {}: {e}", path.display()));
    text.lines()
        .find_map(|l| {
            let rest = l
                .trim()
                .strip_prefix("pub const DSV4_ABI_VERSION_MAJOR: u32 =")?;
            rest.trim().strip_suffix(';')?.trim().parse().ok()
        })
        .unwrap_or_else(|| {
            panic!(
                "dsv4 build.rs: no `pub const DSV4_ABI_VERSION_MAJOR: u32 = N;` in {}",
                path.display()
            )
        })
}

/// The header text cbindgen produces from `src/ffi/mod.rs` (and its submodules) with
/// `cbindgen.toml`. `tests/header_drift.rs` runs the same steps.
fn generate(root: &std::path::Path) -> Result<String, String> {
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml"))
        .map_err(|e| format!("cbindgen.toml: {e}"))?;
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src").join("ffi").join("mod.rs"))
        .generate()
        .map_err(|e| format!("cbindgen: {e}"))?;
    let mut buf = Vec::new();
    bindings.write(&mut buf);
    String::from_utf8(buf).map_err(|e| format!("cbindgen output is not UTF-8: {e}"))
}
