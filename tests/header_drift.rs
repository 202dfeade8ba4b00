//! The committed C header `include/dsv4.h` must equal what cbindgen generates from
//! `src/ffi` with `cbindgen.toml` (the same steps as build.rs). CI sets `CI`, so build.rs
//! does not rewrite the header there and this test catches a stale commit.

use std::path::Path;

#[test]
fn committed_header_matches_cbindgen() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/ffi/mod.rs"))
        .generate()
        .expect("cbindgen generates the header from src/ffi");
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let fresh = String::from_utf8(fresh).expect("UTF-8 header");

    let tmp = std::env::temp_dir().join(format!("dsv4-header-drift-{}.h", std::process::id()));
    std::fs::write(&tmp, &fresh).expect("write the fresh header to a temp file");

    let committed = std::fs::read_to_string(root.join("include/dsv4.h")).unwrap_or_default();
    if committed != fresh {
        let first = committed
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(fresh.lines().count()));
        panic!(
            "include/dsv4.h is stale (first difference at line {}); the fresh header is at {}.\n\
             Regenerate it with `cargo build` (without CI set) and commit it.",
            first + 1,
            tmp.display()
        );
    }
    let _ = std::fs::remove_file(&tmp);
    // The header keeps the essentials a host relies on.
    for needle in [
        "#ifndef DSV4_H",
        "extern \"C\"",
        "#include <stdint.h>",
        "DSV4_ABI_VERSION_MAJOR",
        "dsv4_forward",
    ] {
        assert!(fresh.contains(needle), "header lacks `{needle}`");
    }
}
