//! Every kernel declaration (`kernel_family!`, src/cuda/decl.rs) against the `extern "C"
//! __global__` signature in its .cu source: same entry points, and for each the same number
//! of parameters with the same C types in the same order. The declaration is what the Rust
//! side packs into the launch, so a mismatch would pass garbage to the kernel. Also: a kernel
//! declared `#[pdl(true)]` (launched before the kernel ahead of it has finished) has
//! `dsv4_pdl_begin();` as its first statement, and only such kernels do. Text only: no GPU and
//! no NVRTC needed.

use dsv4::cuda::registry::{KernelFn, KernelSource, families};

/// One `extern "C" __global__` entry point parsed from a source: name and C parameter types.
#[derive(Debug, PartialEq)]
struct Signature {
    name: String,
    params: Vec<String>,
    /// The body's first statement is `dsv4_pdl_begin();` or `dsv4_pdl_trigger();`.
    pdl_begin: bool,
}

/// The source without comments (so commented-out kernels and parameter notes are ignored).
fn strip_comments(src: &str) -> String {
    let (mut out, mut rest) = (String::with_capacity(src.len()), src);
    while let Some(i) = rest.find('/') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("//") {
            rest = tail.find('\n').map_or("", |e| &tail[e..]);
        } else if tail.starts_with("/*") {
            rest = tail.find("*/").map_or("", |e| &tail[e + 2..]);
            out.push(' ');
        } else {
            out.push('/');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// A parameter's C type as `Param::C` spells it: the name dropped, `__restrict__` ignored,
/// one space between words, `*` attached, `unsigned int` as `unsigned`.
fn normalise_param(p: &str) -> Result<String, String> {
    let spaced = p.replace('*', " * ").replace('&', " & ");
    let mut words: Vec<&str> = spaced
        .split_whitespace()
        .filter(|w| *w != "__restrict__")
        .collect();
    match words.last() {
        Some(w) if w.chars().all(|c| c.is_alphanumeric() || c == '_') && words.len() > 1 => {
            words.pop();
        }
        _ => return Err(format!("cannot find the name of parameter `{}`", p.trim())),
    }
    let mut ty = String::new();
    for w in words {
        if w == "*" {
            ty.push('*');
        } else {
            if !ty.is_empty() {
                ty.push(' ');
            }
            ty.push_str(w);
        }
    }
    Ok(ty.replace("unsigned int", "unsigned"))
}

/// Every `extern "C" __global__` entry point of `src`, in source order.
fn parse_entry_points(src: &str) -> Result<Vec<Signature>, String> {
    let src = strip_comments(src);
    let mut out = Vec::new();
    let mut rest = src.as_str();
    while let Some(i) = rest.find("extern \"C\"") {
        rest = rest[i + "extern \"C\"".len()..].trim_start();
        let Some(after) = rest.strip_prefix("__global__") else {
            continue; // an extern "C" device function or variable
        };
        let mut s = after.trim_start();
        s = s
            .strip_prefix("void")
            .ok_or("a __global__ function must return void")?
            .trim_start();
        if let Some(lb) = s.strip_prefix("__launch_bounds__") {
            let close = lb.find(')').ok_or("unclosed __launch_bounds__")?;
            s = lb[close + 1..].trim_start();
        }
        let open = s.find('(').ok_or("entry point without parameter list")?;
        let name = s[..open].trim().to_string();
        let close = s[open..].find(')').ok_or("unclosed parameter list")? + open;
        let list = s[open + 1..close].trim();
        let params = if list.is_empty() || list == "void" {
            Vec::new()
        } else {
            list.split(',')
                .map(normalise_param)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("{name}: {e}"))?
        };
        let body = s[close + 1..].trim_start();
        let body = body.strip_prefix('{').ok_or(format!("{name}: no body"))?;
        // dsv4_pdl_trigger(): weights may be read before the kernel's dsv4_pdl_wait() (common.cuh).
        let first = body.trim_start();
        let pdl_begin =
            first.starts_with("dsv4_pdl_begin();") || first.starts_with("dsv4_pdl_trigger();");
        out.push(Signature {
            name,
            params,
            pdl_begin,
        });
        rest = &s[close..];
    }
    Ok(out)
}

/// Every difference between a family's declarations and its source (empty: they agree).
fn mismatches(family: &str, source: &str, functions: &[KernelFn]) -> Vec<String> {
    let parsed = match parse_entry_points(source) {
        Ok(p) => p,
        Err(e) => return vec![format!("{family}.cu: {e}")],
    };
    let mut errs = Vec::new();
    for f in functions {
        let Some(sig) = parsed.iter().find(|s| s.name == f.name) else {
            errs.push(format!(
                "{family}: `{}` is declared but {family}.cu has no extern \"C\" __global__ of that name",
                f.name
            ));
            continue;
        };
        let declared: Vec<&str> = f.params.to_vec();
        if sig.params != declared {
            errs.push(format!(
                "{family}::{}: declared ({}) but {family}.cu has ({})",
                f.name,
                declared.join(", "),
                sig.params.join(", ")
            ));
        }
        if sig.pdl_begin != f.pdl {
            errs.push(format!(
                "{family}::{}: declared with pdl {} but its body {} with dsv4_pdl_begin();",
                f.name,
                f.pdl,
                if sig.pdl_begin {
                    "begins"
                } else {
                    "does not begin"
                }
            ));
        }
    }
    for s in &parsed {
        if !functions.iter().any(|f| f.name == s.name) {
            errs.push(format!(
                "{family}.cu: `{}` is an entry point without a declaration",
                s.name
            ));
        }
        if parsed.iter().filter(|o| o.name == s.name).count() > 1 {
            errs.push(format!("{family}.cu: `{}` defined twice", s.name));
        }
    }
    errs
}

#[test]
fn every_declaration_matches_its_kernel_source() {
    let mut errs = Vec::new();
    let mut kernels = 0;
    for fam in families() {
        errs.extend(mismatches(fam.family, fam.source, fam.functions));
        kernels += fam.functions.len();
    }
    assert!(errs.is_empty(), "{}", errs.join("\n"));
    println!("{kernels} entry points checked");
}

#[test]
fn parser_reads_launch_bounds_comments_and_every_type_class() {
    let src = r#"
        // extern "C" __global__ void commented_out(int x) {}
        extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
            a(const float* x, int n, long long m, float s, unsigned long long* p,
              const unsigned* u, unsigned short *b, void* v, const double* __restrict__ d) {}
        extern "C" __device__ int not_a_kernel;
        extern "C" __global__ void b() {
          // overlaps the kernel before it
          dsv4_pdl_begin(); }
    "#;
    let sigs = parse_entry_points(src).unwrap();
    assert_eq!(
        sigs,
        [
            Signature {
                name: "a".into(),
                params: [
                    "const float*",
                    "int",
                    "long long",
                    "float",
                    "unsigned long long*",
                    "const unsigned*",
                    "unsigned short*",
                    "void*",
                    "const double*",
                ]
                .map(String::from)
                .to_vec(),
                pdl_begin: false,
            },
            Signature {
                name: "b".into(),
                params: vec![],
                pdl_begin: true,
            },
        ]
    );
}

/// The check catches a parameter added, removed, reordered or retyped on either side, and
/// entry points missing on either side. Each case edits one real family.
#[test]
fn any_drift_between_declaration_and_source_is_caught() {
    let fam: &KernelSource = families()
        .into_iter()
        .find(|f| f.family == "linear")
        .unwrap();
    assert!(mismatches(fam.family, fam.source, fam.functions).is_empty());
    let sig = "act_quant_kernel(const float* x, int ldx, int rows, int K, float* xq)";
    assert!(
        fam.source.contains(sig),
        "linear.cu changed; update this test"
    );

    // Source side.
    for edited in [
        "act_quant_kernel(const float* x, int ldx, int rows, int K, float* xq, int extra)",
        "act_quant_kernel(const float* x, int ldx, int rows, float* xq)",
        "act_quant_kernel(const float* x, int rows, int ldx, float* xq, int K)",
        "act_quant_kernel(const float* x, int ldx, int rows, int K, const float* xq)",
        "act_quant_kernel(float* x, int ldx, int rows, int K, float* xq)",
        "act_quant_kernel(const float* x, long long ldx, int rows, int K, float* xq)",
        "act_quant_kernel(const float* x, int ldx, int rows, float K, float* xq)",
        "act_quant_kernel2(const float* x, int ldx, int rows, int K, float* xq)",
    ] {
        let src = fam.source.replace(sig, edited);
        assert!(
            !mismatches(fam.family, &src, fam.functions).is_empty(),
            "not caught: {edited}"
        );
    }

    // Declaration side.
    let decl = fam
        .functions
        .iter()
        .find(|f| f.name == "act_quant_kernel")
        .unwrap();
    let others: Vec<KernelFn> = fam
        .functions
        .iter()
        .filter(|f| f.name != decl.name)
        .copied()
        .collect();
    let edits: [&'static [&'static str]; 4] = [
        &["const float*", "int", "int", "int", "float*", "int"],
        &["const float*", "int", "int", "float*"],
        &["const float*", "int", "int", "float*", "int"],
        &["const float*", "int", "int", "long long", "float*"],
    ];
    for params in edits {
        let mut fns = others.clone();
        fns.push(KernelFn { params, ..*decl });
        assert!(
            !mismatches(fam.family, fam.source, &fns).is_empty(),
            "not caught: {params:?}"
        );
    }
    assert!(
        !mismatches(fam.family, fam.source, &others).is_empty(),
        "an undeclared entry point is not caught"
    );
    let mut flipped = others.clone();
    flipped.push(KernelFn {
        pdl: !decl.pdl,
        ..*decl
    });
    assert!(
        !mismatches(fam.family, fam.source, &flipped).is_empty(),
        "a pdl declaration that disagrees with the body is not caught"
    );
    let mut extra = fam.functions.to_vec();
    extra.push(KernelFn {
        name: "no_such_kernel",
        ..*decl
    });
    assert!(
        !mismatches(fam.family, fam.source, &extra).is_empty(),
        "a declaration without a kernel is not caught"
    );
}
