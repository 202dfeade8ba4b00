//! GPU op tests of the `linear` kernel family (kernels/linear.cu) against the CPU reference,
//! BIT FOR BIT: `linear_kernel` vs `ops::matmul_mat` (+ BF16 rounding) for weights stored F32,
//! BF16, FP8 (several scale blocks) and FP4, strided and ragged shapes, row-offset weights;
//! `act_quant_kernel` vs `quant::fp8_sim(·, 128)`; and the composite `Prec::linear` (act_quant +
//! linear) on a quantized `WeightStore` in both numerics modes.
//!
//! Inputs are fresh random values each run (seed printed; `DSV4_TEST_SEED=<n>` repeats one);
//! outputs are poisoned with NaN first. Without a CUDA device every test prints
//! `skipped: no CUDA device` and returns.

mod common;

use common::assert_bits;
use common::gpu::{alloc, family_gpu, print_kernel_resources, weight_dev};
use common::rng::Rng;
use dsv4::cuda::arena;
use dsv4::cuda::kernels::linear::{self, Linear, StorageFormat, WeightDev};
use dsv4::cuda::{BorrowedStream, Context, DevicePtr, OwnedStream};
use dsv4::reference::ops::{Threads, matmul_mat};
use dsv4::reference::precision::Prec;
use dsv4::weights::WeightFormat;
use dsv4::weights::qmatrix::{QFormat, QMatrix};
use dsv4::weights::quant::{fp8_sim, round_bf16};
use dsv4::weights::store::{MatRef, TensorData, WeightStore};
use std::sync::OnceLock;

const TH: Threads = Threads(4);
const POISON: u32 = 0xffff_ffff;

// ------------------------------------------------------------------------------ harness

struct Env {
    ctx: &'static Context,
    lin: Linear,
}

/// The device, the `linear` family compiled and loaded, and a fresh
/// stream for one test; or None after printing the skip line.
fn env() -> Option<(&'static Env, OwnedStream)> {
    static ENV: OnceLock<Env> = OnceLock::new();
    let g = family_gpu(&[&linear::SOURCE])?;
    let e = ENV.get_or_init(|| {
        print_kernel_resources(&g.reg);
        Env {
            ctx: &g.ctx,
            lin: Linear::new(&g.reg).unwrap(),
        }
    });
    Some((e, OwnedStream::new(e.ctx).unwrap()))
}

fn upload<T: arena::Pod>(p: DevicePtr, v: &[T], s: BorrowedStream) {
    arena::copy_to_device_sync(p, v, s).unwrap();
}

fn download_f32(p: DevicePtr, n: usize, s: BorrowedStream) -> Vec<f32> {
    let mut v = vec![0f32; n];
    arena::copy_to_host_sync(&mut v, p, s).unwrap();
    v
}

/// Contiguous rows `x` [rows, k] laid out at stride `ldx` with NaN in the gaps.
fn strided(x: &[f32], rows: usize, k: usize, ldx: usize) -> Vec<f32> {
    let mut xs = vec![f32::NAN; linear::strided_bytes(rows, k, ldx) / 4];
    for r in 0..rows {
        xs[r * ldx..r * ldx + k].copy_from_slice(&x[r * k..(r + 1) * k]);
    }
    xs
}

fn poison(p: DevicePtr, s: BorrowedStream) {
    arena::memset_async(p, 0xff, s).unwrap();
}

// ------------------------------------------------------------------------------ weights

/// A weight in host form (as the CPU store holds it) plus its raw bytes for the device.
struct HostWeight {
    format: StorageFormat,
    rows: usize,
    cols: usize,
    block: [usize; 2],
    f32v: Vec<f32>,
    bf16v: Vec<u16>,
    q: Option<QMatrix>,
}

impl HostWeight {
    fn new(
        format: StorageFormat,
        rows: usize,
        cols: usize,
        block: [usize; 2],
        src: &[f32],
    ) -> HostWeight {
        let mut h = HostWeight {
            format,
            rows,
            cols,
            block,
            f32v: vec![],
            bf16v: vec![],
            q: None,
        };
        match format {
            StorageFormat::F32 => h.f32v = src.to_vec(),
            StorageFormat::Bf16 => {
                h.bf16v = src
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect()
            }
            StorageFormat::Fp8 | StorageFormat::Fp4 => {
                let qf = if format == StorageFormat::Fp8 {
                    QFormat::Fp8 { block }
                } else {
                    QFormat::Fp4
                };
                let mut q = QMatrix::zeros(qf, rows, cols);
                q.quantize_from(src);
                h.q = Some(q);
            }
        }
        h
    }

    fn mat(&self) -> MatRef<'_> {
        match self.format {
            StorageFormat::F32 => MatRef::F32(&self.f32v),
            StorageFormat::Bf16 => MatRef::Bf16(&self.bf16v),
            _ => MatRef::Quant(self.q.as_ref().unwrap()),
        }
    }

    fn data_bytes(&self) -> usize {
        self.format.data_bytes(self.rows, self.cols)
    }

    fn scale_bytes(&self) -> usize {
        4 * self.format.scale_count(self.rows, self.cols, self.block)
    }

    fn upload(&self, data: DevicePtr, scales: DevicePtr, s: BorrowedStream) -> WeightDev {
        match self.format {
            StorageFormat::F32 => upload(data, &self.f32v, s),
            StorageFormat::Bf16 => upload(data, &self.bf16v, s),
            _ => {
                let q = self.q.as_ref().unwrap();
                upload(data, &q.codes, s);
                upload(scales, &q.scales, s);
            }
        }
        weight_dev(
            self.format,
            [self.rows, self.cols],
            self.block,
            (data, self.data_bytes()),
            (scales, self.scale_bytes()),
        )
    }
}

// ------------------------------------------------------------------------------ linear

struct Case {
    t: usize,
    k: usize,
    n: usize,
    /// Extra rows of W before the used ones (a row offset through WeightDev::rows).
    row0: usize,
    ldx_pad: usize,
    ldy_pad: usize,
    wild: bool,
}

#[allow(clippy::too_many_arguments)]
fn run_linear_case(
    e: &Env,
    s: BorrowedStream,
    rng: &mut Rng,
    format: StorageFormat,
    block: [usize; 2],
    c: &Case,
) {
    let (t, k, n) = (c.t, c.k, c.n);
    let (ldx, ldy) = (k + c.ldx_pad, n + c.ldy_pad);
    let rows = c.row0 + n;
    let wsrc = rng.values(rows * k, c.wild);
    let hw = HostWeight::new(format, rows, k, block, &wsrc);
    // x contiguous for the reference; strided with NaN gaps for the device.
    let xc = rng.values(t * k, c.wild);
    let xs = strided(&xc, t, k, ldx);
    let ybytes = linear::strided_bytes(t, n, ldy);
    let (_a, p) = alloc(
        e.ctx,
        &[xs.len() * 4, hw.data_bytes(), hw.scale_bytes(), ybytes],
    );
    let _g = e.ctx.enter().unwrap();
    upload(p[0], &xs, s);
    let w = hw.upload(p[1], p[2], s).rows(c.row0, n).unwrap();
    let x = p[0].slice(0, xs.len() * 4).unwrap();
    let y = p[3].slice(0, ybytes).unwrap();

    for round in [false, true] {
        let mut want = vec![0f32; t * n];
        matmul_mat(TH, &xc, k, hw.mat(), c.row0, n, &mut want);
        if round {
            round_bf16(&mut want);
        }
        poison(p[3], s);
        e.lin
            .linear(e.ctx, x, ldx, t, &w, n, round, y, ldy, s)
            .unwrap();
        let yall = download_f32(y, ybytes / 4, s);
        let mut got = vec![0f32; t * n];
        for ti in 0..t {
            got[ti * n..(ti + 1) * n].copy_from_slice(&yall[ti * ldy..ti * ldy + n]);
            if ti + 1 < t {
                for (j, v) in yall[ti * ldy + n..(ti + 1) * ldy].iter().enumerate() {
                    assert_eq!(
                        v.to_bits(),
                        POISON,
                        "linear wrote into the y stride gap: row {ti}, column {}",
                        n + j
                    );
                }
            }
        }
        assert_bits(
            &format!(
                "linear {format:?} block {block:?} T={t} K={k} N={n} row0={} ldx={ldx} ldy={ldy} wild={} round={round}",
                c.row0, c.wild
            ),
            &got,
            &want,
        );
    }
}

#[test]
fn linear_matches_matmul_mat_bit_for_bit_in_every_format() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let mut rng = Rng::from_env("linear");
    let case = |t, k, n, row0, ldx_pad, ldy_pad, wild| Case {
        t,
        k,
        n,
        row0,
        ldx_pad,
        ldy_pad,
        wild,
    };
    // Ragged everything: K below / across / not a multiple of the 32-column stage and of 4 (the
    // reference's lane tail), N and T below, at and across their tiles, strides with gaps.
    let shapes = [
        case(1, 1, 1, 0, 0, 0, false),
        case(1, 2, 1, 0, 0, 0, true),
        case(1, 256, 1, 0, 0, 0, false),
        case(1, 7, 65, 0, 3, 0, true),
        case(2, 33, 64, 0, 0, 0, false),
        case(37, 300, 100, 0, 5, 3, false),
        case(37, 130, 129, 0, 0, 0, true),
        case(64, 96, 64, 0, 0, 0, false),
        case(33, 1030, 70, 0, 1, 7, true),
        case(300, 258, 130, 0, 0, 0, false),
        case(5, 1, 3, 0, 2, 2, false),
        // Around the skinny / tiled switch (T <= 16: 8-row skinny blocks).
        case(8, 130, 70, 0, 0, 1, false),
        case(9, 64, 64, 0, 2, 0, true),
        case(16, 33, 129, 0, 0, 0, false),
        case(17, 200, 65, 0, 1, 0, false),
    ];
    let mut count = 0;
    for (format, block) in [
        (StorageFormat::F32, [0, 0]),
        (StorageFormat::Bf16, [0, 0]),
        (StorageFormat::Fp8, [128, 128]),
        (StorageFormat::Fp8, [16, 48]),
        (StorageFormat::Fp8, [1, 1]),
        (StorageFormat::Fp4, [0, 0]),
    ] {
        for c in &shapes {
            run_linear_case(e, s, &mut rng, format, block, c);
            count += 1;
        }
        // A row-offset view (FP8: a multiple of the block rows).
        let row0 = if format == StorageFormat::Fp8 {
            block[0] * 2
        } else {
            5
        };
        run_linear_case(
            e,
            s,
            &mut rng,
            format,
            block,
            &case(9, 200, 40, row0, 1, 1, false),
        );
        count += 1;
    }
    println!("linear: {count} cases x 2 roundings bit-exact");
}

#[test]
fn linear_refuses_out_of_bounds_launches() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let (_a, p) = alloc(e.ctx, &[4 * 10 * 16, 4 * 8 * 16, 4 * 10 * 8]);
    let w = WeightDev {
        format: StorageFormat::F32,
        data: p[1],
        scales: None,
        block: [0, 0],
        rows: 8,
        cols: 16,
    };
    let l = &e.lin;
    assert!(
        l.linear(e.ctx, p[0], 16, 10, &w, 8, false, p[2], 8, s)
            .is_ok()
    );
    assert!(
        l.linear(e.ctx, p[0], 16, 11, &w, 8, false, p[2], 8, s)
            .is_err(),
        "x too small"
    );
    assert!(
        l.linear(e.ctx, p[0], 16, 10, &w, 9, false, p[2], 9, s)
            .is_err(),
        "N > rows"
    );
    assert!(
        l.linear(e.ctx, p[0], 15, 10, &w, 8, false, p[2], 8, s)
            .is_err(),
        "ldx < K"
    );
    assert!(
        l.linear(e.ctx, p[0], 16, 10, &w, 8, false, p[2], 9, s)
            .is_err(),
        "y too small"
    );
    let fp8 = WeightDev {
        format: StorageFormat::Fp8,
        scales: None,
        block: [4, 4],
        ..w
    };
    assert!(
        l.linear(e.ctx, p[0], 16, 10, &fp8, 8, false, p[2], 8, s)
            .is_err(),
        "no scales"
    );
    assert!(
        l.act_quant(e.ctx, p[0], 16, 10, 16, p[2], s).is_err(),
        "xq too small"
    );
    s.synchronize().unwrap();
}

// ------------------------------------------------------------------------------ act_quant

#[test]
fn act_quant_matches_fp8_sim_bit_for_bit() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let mut rng = Rng::from_env("act_quant");
    for (rows, k, pad) in [
        (1, 1, 0),
        (1, 128, 0),
        (3, 129, 4),
        (37, 300, 0),
        (300, 256, 1),
        (5, 1000, 0),
        (2, 7168, 0),
    ] {
        let ldx = k + pad;
        let mut xc: Vec<f32> = (0..rows * k)
            .map(|i| match i % 11 {
                0 => rng.wild() * 1e3,
                1 => rng.wild() * 1e-30, // tiny and subnormal magnitudes
                _ => rng.uniform(-3.0, 3.0),
            })
            .collect();
        // An all-zero block and a block of tiny values (amax floor 1e-4) in the first row.
        for v in xc.iter_mut().take(k.min(128)) {
            *v = 0.0;
        }
        if k > 128 {
            for v in xc.iter_mut().skip(128).take((k - 128).min(128)) {
                *v *= 1e-7;
            }
        }
        let xs = strided(&xc, rows, k, ldx);
        let mut want = xc.clone();
        want.chunks_exact_mut(k).for_each(|r| fp8_sim(r, 128));
        let (_a, p) = alloc(e.ctx, &[xs.len() * 4, rows * k * 4]);
        let _g = e.ctx.enter().unwrap();
        upload(p[0], &xs, s);
        poison(p[1], s);
        let x = p[0].slice(0, xs.len() * 4).unwrap();
        let xq = p[1].slice(0, rows * k * 4).unwrap();
        e.lin.act_quant(e.ctx, x, ldx, rows, k, xq, s).unwrap();
        let got = download_f32(xq, rows * k, s);
        assert_bits(
            &format!("act_quant rows={rows} K={k} ldx={ldx}"),
            &got,
            &want,
        );
        // In place (ldx == K).
        if pad == 0 {
            upload(p[0], &xc, s);
            e.lin.act_quant(e.ctx, x, k, rows, k, x, s).unwrap();
            let got = download_f32(x, rows * k, s);
            assert_bits(
                &format!("act_quant in place rows={rows} K={k}"),
                &got,
                &want,
            );
        }
    }
}

// ------------------------------------------------------------------- Prec::linear composite

/// `Prec::linear` of the reference (act_quant when official and the weight is quantized,
/// matmul, BF16 when official) against act_quant_kernel + linear_kernel, on weights of a
/// dummy-filled tiny model in each storage.
#[test]
fn prec_linear_matches_the_reference_in_both_modes() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let mut rng = Rng::from_env("prec_linear");
    let cfg = dsv4::ModelConfig::tiny_default();
    let names = [
        "layers.0.attn.wq_a.weight",
        "layers.1.attn.wo_b.weight",
        "layers.2.ffn.experts.3.w2.weight",
        "layers.3.ffn.shared_experts.w1.weight",
    ];
    let mut cases = 0;
    for format in [
        WeightFormat::AsStored,
        WeightFormat::Bf16,
        WeightFormat::Quantize,
    ] {
        let mut store = WeightStore::allocate_with(&cfg, format).unwrap();
        dsv4::weights::dummy::fill_dummy(&mut store, &cfg, rng.u64());
        for name in names {
            let idx = store.require(name).unwrap();
            let (n, k) = {
                let sp = &store.tensor(idx).spec;
                (sp.shape[0], sp.shape[1])
            };
            let hw = match &store.tensor(idx).data {
                TensorData::F32(v) => HostWeight::new(StorageFormat::F32, n, k, [0, 0], v),
                TensorData::Bf16(v) => HostWeight {
                    format: StorageFormat::Bf16,
                    rows: n,
                    cols: k,
                    block: [0, 0],
                    f32v: vec![],
                    bf16v: v.clone(),
                    q: None,
                },
                TensorData::Quant(q) => {
                    let block = match q.format {
                        QFormat::Fp8 { block } => block,
                        QFormat::Fp4 => [0, 0],
                    };
                    let mut copy = QMatrix::zeros(q.format, q.rows, q.cols);
                    copy.codes.copy_from_slice(&q.codes);
                    copy.scales.copy_from_slice(&q.scales);
                    HostWeight {
                        format: StorageFormat::of_qformat(q.format),
                        rows: n,
                        cols: k,
                        block,
                        f32v: vec![],
                        bf16v: vec![],
                        q: Some(copy),
                    }
                }
                TensorData::I32(_) => unreachable!(),
            };
            for t in [1usize, 37] {
                let x: Vec<f32> = rng
                    .values(t * k, false)
                    .into_iter()
                    .map(|v| half::bf16::from_f32(v * 2.0).to_f32())
                    .collect();
                let (_a, p) = alloc(
                    e.ctx,
                    &[
                        t * k * 4,
                        t * k * 4,
                        hw.data_bytes(),
                        hw.scale_bytes(),
                        t * n * 4,
                    ],
                );
                let _g = e.ctx.enter().unwrap();
                upload(p[0], &x, s);
                let w = hw.upload(p[2], p[3], s);
                let (xd, xq) = (
                    p[0].slice(0, t * k * 4).unwrap(),
                    p[1].slice(0, t * k * 4).unwrap(),
                );
                for official in [false, true] {
                    let want = Prec { official }.linear(TH, &store, idx, &x, k);
                    poison(p[1], s);
                    poison(p[4], s);
                    let input = if official && store.is_quantized(idx) {
                        e.lin.act_quant(e.ctx, xd, k, t, k, xq, s).unwrap();
                        xq
                    } else {
                        xd
                    };
                    e.lin
                        .linear(e.ctx, input, k, t, &w, n, official, p[4], n, s)
                        .unwrap();
                    let got = download_f32(p[4], t * n, s);
                    assert_bits(
                        &format!(
                            "Prec::linear {name} ({format:?}, {:?}) T={t} official={official}",
                            hw.format
                        ),
                        &got,
                        &want,
                    );
                    cases += 1;
                }
            }
        }
    }
    println!("Prec::linear: {cases} cases bit-exact");
}

// ------------------------------------------------------------------------------ benchmark

/// Random stored bytes of a `rows x cols` weight (FP8 codes avoid NaN) with unit-ish scales.
fn random_weight(
    rng: &mut Rng,
    format: StorageFormat,
    rows: usize,
    cols: usize,
    block: [usize; 2],
) -> (Vec<u8>, Vec<f32>) {
    let nb = format.data_bytes(rows, cols);
    let mut data = Vec::with_capacity(nb + 8);
    while data.len() < nb {
        data.extend_from_slice(&rng.u64().to_le_bytes());
    }
    data.truncate(nb);
    match format {
        StorageFormat::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&(((c[0] as f32) - 128.0) / 4096.0).to_le_bytes());
            }
        }
        StorageFormat::Bf16 => {
            for c in data.chunks_exact_mut(2) {
                c[1] = (c[1] & 0x80) | 0x3c; // |v| in [2^-7, 2^-6)
            }
        }
        StorageFormat::Fp8 => data
            .iter_mut()
            .filter(|b| **b & 0x7f == 0x7f)
            .for_each(|b| *b ^= 1),
        StorageFormat::Fp4 => {}
    }
    let scales = vec![1.0 / 64.0; format.scale_count(rows, cols, block)];
    (data, scales)
}

/// Throughput of linear_kernel and act_quant_kernel on DeepSeek-V4-Flash-like shapes. Not a
/// correctness test: run with `--ignored --nocapture` on a GPU.
#[test]
#[ignore = "benchmark: run with --ignored --nocapture on a GPU"]
fn linear_throughput() {
    let Some((e, stream)) = env() else { return };
    let s = stream.borrow();
    let mut rng = Rng::from_env("bench");
    let time = |f: &mut dyn FnMut()| -> f64 {
        f();
        s.synchronize().unwrap();
        let mut iters = 0;
        let t0 = std::time::Instant::now();
        while iters < 3 || (t0.elapsed().as_secs_f64() < 0.2 && iters < 200) {
            f();
            iters += 1;
            if iters % 10 == 0 {
                s.synchronize().unwrap();
            }
        }
        s.synchronize().unwrap();
        t0.elapsed().as_secs_f64() / iters as f64
    };
    for (n, k) in [(4096usize, 4096usize), (1024, 4096), (2048, 4096)] {
        for format in [StorageFormat::Bf16, StorageFormat::Fp8, StorageFormat::Fp4] {
            let block = [128, 128];
            let (data, scales) = random_weight(&mut rng, format, n, k, block);
            let tmax = 2048;
            let x: Vec<f32> = rng.values(tmax * k, false);
            let (_a, p) = alloc(
                e.ctx,
                &[x.len() * 4, data.len(), scales.len() * 4, tmax * n * 4],
            );
            let _g = e.ctx.enter().unwrap();
            upload(p[0], &x, s);
            upload(p[1], &data, s);
            upload(p[2], &scales, s);
            let w = WeightDev {
                format,
                data: p[1],
                scales: format.is_quantized().then_some(p[2]),
                block,
                rows: n,
                cols: k,
            };
            let mut line = format!("linear {format:?} N={n} K={k}:");
            for t in [1usize, 8, 64, 512, 2048] {
                let dt = time(&mut || {
                    e.lin
                        .linear(e.ctx, p[0], k, t, &w, n, true, p[3], n, s)
                        .unwrap()
                });
                let tflops = 2.0 * (t * n * k) as f64 / dt / 1e12;
                line += &format!(" T={t}: {:.1} us ({tflops:.2} TF/s);", dt * 1e6);
            }
            println!("{line}");
        }
    }
    let (rows, k) = (4096usize, 4096usize);
    let (_a, p) = alloc(e.ctx, &[rows * k * 4, rows * k * 4]);
    let dt = time(&mut || e.lin.act_quant(e.ctx, p[0], k, rows, k, p[1], s).unwrap());
    println!(
        "act_quant {rows}x{k}: {:.1} us ({:.0} GB/s)",
        dt * 1e6,
        (rows * k * 8) as f64 / dt / 1e9
    );
}
