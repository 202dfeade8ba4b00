//! GPU op test of the fast set's sparse attention (kernels/fast_attention.cu: both kernels, the
//! mma.sync one and the wgmma one) against the reference attention kernel (kernels/attention.cu)
//! on the same device state, at Flash shapes
//! (64 heads of 512, 448 FP8 nope channels + 64 BF16 RoPE, window 128, CSA top-512, HCA ratio
//! 128): decode batches of 1, 8 and 64 tokens (split over blocks) and prefill chunks of 300
//! (one block per token), contexts up to 64K (CSA) and 256K (HCA), a ring still filling, HCA
//! with no entry yet, CSA with no selection, padding. The state is random official-format pages
//! (codes, UE8M0 scales, BF16 RoPE) reached through a scrambled block table.
//!
//! The error bound, per output value o[t, h, c] (derived in `bound` below) uses the exact
//! softmax weights w_j = e^{l_j - m} / (Σ e^{l - m} + e^{sink - m}) computed here in f64, and
//! S_c = Σ_j w_j |v_jc|: both kernels round p_j to BF16 (2^-9 relative each, the fast one from
//! its lazy running max), the fast exponentials are the SFU's (`fa_exp`: relative error
//! ε_exp = 2^-21 + (g + 6) 2^-23, g = max_j (m - l_j), the 6 for the lazy max's lag of up to 5.5),
//! the fast logits carry the tensor core's f32 accumulation (a chain of hd/32
//! k16 steps in either kernel, then the two dims halves added:
//! δ_j = (hd/32 + 3) 2^-22 scale Σ_i |q_i k_ji|), its P·V and denominators f32 sums, and both
//! outputs are rounded to BF16:
//! |o_fast - o_ref| <= (1 + 2^-8) [S_c (2^-8 + 2.1 max δ + ε_acc + ε_exp) + (ε_den + ε_exp) |o_ref|] +
//! 2^-8 (1 + 2^-8) |o_ref|,
//! ε_acc = (nk/16 + 4) 2^-22, ε_den = (nk + 20) 2^-23.
//! Also: the fast kernel is bit-identical run to run and padding tokens get zeros, and every kernel
//! (and each bench variant of `VARIANTS`, compiled with its define) gives mma.sync's bits.
//!
//! Without a CUDA device the GPU tests print `skipped: no CUDA device`.

mod common;

use common::gpu::{alloc, assert_families_compile, family_gpu, print_kernel_resources};
use common::kv::{BatchLayout, scrambled_table};
use common::rng::XorShift;
use dsv4::cuda::arena;
use dsv4::cuda::kernels::attention::{self, Attention, AttentionArgs, BatchMeta};
use dsv4::cuda::kernels::fast_attention::{
    self, AttentionPath, FastAttention, FastAttentionWorkspace, SplitCombine, splits,
    workspace_floats,
};
use dsv4::cuda::kv_pages::{KV_PAGE, KvFormat, KvPagesDev, KvRows};
use dsv4::cuda::registry::{KernelCache, KernelSource, Registry};
use dsv4::cuda::{BorrowedStream, DevicePtr, OwnedStream};
use dsv4::reference::precision::Prec;
use std::sync::{Mutex, OnceLock};

const FAMILIES: [&KernelSource; 2] = [&attention::SOURCE, &fast_attention::SOURCE];

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const H: usize = 64;
const HD: usize = 512;
const NOPE: usize = 448;
const W: usize = 128;
const TOPK: usize = 512;
const SLOTS: usize = 3;

#[test]
fn families_compile_for_sm_90a() {
    assert_families_compile(&FAMILIES);
}

/// One layer's state on the host (what the device holds, byte for byte) and its description.
struct State {
    ratio: usize,
    csa: bool,
    maxe: usize,
    ring: Vec<u8>,
    entries: Vec<u8>,
    table: Vec<i32>,
    rows: KvRows,
}

impl State {
    /// Random official pages: e4m3 codes (never NaN), scales 2^-10 .. 2^-6 (one in 64: 2^-118), BF16 RoPE values
    /// in [-1, 1); the entries' block table a permutation of the pool.
    fn random(rng: &mut XorShift, ratio: usize, csa: bool, max_seq_len: usize) -> State {
        let rows = KvRows::kv(KvFormat::Official, HD, NOPE);
        let maxe = max_seq_len.checked_div(ratio).unwrap_or(0);
        let pps = KvRows::pages_for(maxe);
        let pages = |rng: &mut XorShift, n: usize| -> Vec<u8> {
            let mut v = vec![0u8; n * rows.page_bytes()];
            for page in v.chunks_exact_mut(rows.page_bytes()) {
                for r in 0..KV_PAGE {
                    let row = &mut page[r * rows.row_bytes()..][..rows.row_bytes()];
                    for b in &mut row[..NOPE] {
                        *b = loop {
                            let c = rng.below(256) as u8;
                            if c & 0x7f != 0x7f {
                                break c;
                            }
                        };
                    }
                    for c in 0..HD - NOPE {
                        let v = half::bf16::from_f32(rng.f(1.0)).to_bits().to_le_bytes();
                        row[NOPE + 2 * c..NOPE + 2 * c + 2].copy_from_slice(&v);
                    }
                    // (One block in 64 at 2^-118: below FA_DECODE_FAST's range, so that its
                    // variant meets rows of both decodes.)
                    let sc = KV_PAGE * rows.row_bytes() + r * rows.scale_bytes();
                    for b in &mut page[sc..sc + NOPE / 64] {
                        *b = if rng.below(64) == 0 {
                            9
                        } else {
                            117 + rng.below(5) as u8
                        };
                    }
                }
            }
            v
        };
        State {
            ratio,
            csa,
            maxe,
            ring: pages(rng, SLOTS * KvRows::pages_for(W)),
            entries: pages(rng, SLOTS * pps),
            table: scrambled_table(SLOTS * pps),
            rows,
        }
    }

    fn pps(&self) -> usize {
        KvRows::pages_for(self.maxe)
    }

    /// Ring row `r` of `slot`, decoded.
    fn ring_row(&self, slot: usize, r: usize) -> Vec<f32> {
        let pb = self.rows.page_bytes();
        let page = slot * KvRows::pages_for(W) + r / KV_PAGE;
        self.rows
            .decode_row(&self.ring[page * pb..][..pb], r % KV_PAGE)
    }

    /// Entry `e` of `slot`, decoded through the table.
    fn entry(&self, slot: usize, e: usize) -> Vec<f32> {
        let pb = self.rows.page_bytes();
        let page = self.table[slot * self.pps() + e / KV_PAGE] as usize;
        self.rows
            .decode_row(&self.entries[page * pb..][..pb], e % KV_PAGE)
    }
}

/// A batch: its layout and inputs.
struct Batch {
    layout: BatchLayout,
    q: Vec<f32>,
    kv: Vec<f32>,
    selected: Vec<i32>,
    nsel: Vec<i32>,
    sinks: Vec<f32>,
}

impl Batch {
    fn new(rng: &mut XorShift, st: &State, seqs: &[(i32, usize, usize)]) -> Batch {
        let mut b = Batch {
            layout: BatchLayout::new(seqs),
            q: vec![],
            kv: vec![],
            selected: vec![],
            nsel: vec![],
            sinks: rng.vec(H, 2.0, false),
        };
        let t = b.layout.tokens();
        // Official activations: BF16 queries; KV rows FP8-simulated nope + BF16 RoPE.
        b.q = rng.vec(t * H * HD, 1.0, true);
        b.kv = rng.vec(t * HD, 1.0, true);
        Prec { official: true }.kv_nope_sim(&mut b.kv, HD, NOPE);
        b.selected = vec![-1; t * TOPK];
        b.nsel = vec![0; t];
        if st.csa {
            for i in 0..t {
                let visible = ((b.layout.positions[i] as usize + 1) / st.ratio).min(st.maxe);
                let n = visible.min(TOPK);
                let mut pool: Vec<i32> = (0..visible as i32).collect();
                for k in 0..n {
                    let j = k + rng.below((visible - k) as u64) as usize;
                    pool.swap(k, j);
                }
                b.selected[i * TOPK..i * TOPK + n].copy_from_slice(&pool[..n]);
                b.nsel[i] = n as i32;
            }
        }
        b
    }

    fn t(&self) -> usize {
        self.layout.tokens()
    }

    /// Token i's keys (each also its value) in the kernels' order (attn_keys.cuh).
    fn keys(&self, st: &State, i: usize) -> Vec<Vec<f32>> {
        let s = self.layout.seq_of[i] as usize;
        let slot = self.layout.seq_slots[s];
        if slot < 0 {
            return vec![];
        }
        let slot = slot as usize;
        let p = self.layout.positions[i] as usize;
        let t0 = self.layout.query_start[s] as usize;
        let p0 = self.layout.positions[t0] as usize;
        let lo = (p + 1).saturating_sub(W);
        let mut keys: Vec<Vec<f32>> = (lo..=p)
            .map(|pos| {
                if pos < p0 {
                    st.ring_row(slot, pos % W)
                } else {
                    self.kv[(t0 + pos - p0) * HD..][..HD].to_vec()
                }
            })
            .collect();
        if st.csa {
            let n = self.nsel[i] as usize;
            keys.extend(
                self.selected[i * TOPK..i * TOPK + n]
                    .iter()
                    .map(|&e| st.entry(slot, e as usize)),
            );
        } else if let Some(n) = (p + 1).checked_div(st.ratio) {
            keys.extend((0..n.min(st.maxe)).map(|e| st.entry(slot, e)));
        }
        keys
    }
}

/// The derived bound (module doc) for every value of token i's output, from the exact softmax
/// in f64.
fn bound(b: &Batch, st: &State, i: usize, o_ref: &[f32]) -> Vec<f64> {
    let keys = b.keys(st, i);
    let nk = keys.len() as f64;
    let scale = 1.0 / (HD as f64).sqrt();
    let tiny = 2f64.powi(-8);
    let mut out = vec![0.0; H * HD];
    if keys.is_empty() {
        return out; // padding: both kernels write exact zeros
    }
    let eps_acc = (nk / 16.0 + 4.0) * 2f64.powi(-22);
    let eps_den = (nk + 20.0) * 2f64.powi(-23);
    for h in 0..H {
        let q = &b.q[(i * H + h) * HD..][..HD];
        let mut l = Vec::with_capacity(keys.len());
        let mut delta: f64 = 0.0;
        for k in &keys {
            let (mut dot, mut abs) = (0.0f64, 0.0f64);
            for c in 0..HD {
                dot += q[c] as f64 * k[c] as f64;
                abs += (q[c] as f64 * k[c] as f64).abs();
            }
            l.push(dot * scale);
            delta = delta.max((HD as f64 / 32.0 + 3.0) * 2f64.powi(-22) * scale * abs);
        }
        let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let gap = l.iter().map(|x| m - x).fold(0.0, f64::max);
        let eps_exp = 2f64.powi(-21) + (gap + 6.0) * 2f64.powi(-23);
        let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
        let den: f64 = e.iter().sum::<f64>() + (b.sinks[h] as f64 - m).exp();
        for c in 0..HD {
            let s: f64 = keys
                .iter()
                .zip(&e)
                .map(|(k, e)| e / den * (k[c] as f64).abs())
                .sum();
            let o = (o_ref[(i * H + h) * HD + c] as f64).abs();
            out[h * HD + c] = (1.0 + tiny)
                * (s * (tiny + 2.1 * delta + eps_acc + eps_exp) + (eps_den + eps_exp) * o)
                + tiny * (1.0 + tiny) * o
                + 1e-30;
        }
    }
    out
}

/// The fast kernels each case runs: mma.sync, wgmma and the warp-specialized wgmma with either
/// P V schedule (this file's shapes are the wgmma path's), the first two with their splits combined
/// in a cluster where the split count allows (2 to CLUSTER_MAX_SPLITS: the 64-token decodes, some
/// with an empty split) and again through the workspace and fa_combine_kernel. Every output is
/// compared bit for bit with the first, so the cluster combine is checked against the workspace's.
const PATHS: [(AttentionPath, SplitCombine); 6] = [
    (AttentionPath::Mma, SplitCombine::Cluster),
    (AttentionPath::Wgmma, SplitCombine::Cluster),
    (AttentionPath::WgmmaWs, SplitCombine::Cluster),
    (AttentionPath::WgmmaWsEarlyPv, SplitCombine::Cluster),
    (AttentionPath::Mma, SplitCombine::Workspace),
    (AttentionPath::Wgmma, SplitCombine::Workspace),
];

/// Kernel variants (preprocessor defines of fast_attention.cu, `dsv4 bench attn --defines`) whose
/// output must be the default kernels' bits: each runs the kernels it changes (with a cluster
/// combine) after [`PATHS`], from a registry of its own.
const VARIANTS: [(&str, &[AttentionPath]); 2] = [
    ("FA_DECODE_FAST=0", &[AttentionPath::Wgmma]),
    (
        "FA_FETCH_FAST=0",
        &[AttentionPath::Mma, AttentionPath::Wgmma],
    ),
];

/// The variants' registries, compiled once (each is the fast_attention family with its define).
fn variant_registries() -> &'static [Registry] {
    static REGS: OnceLock<Vec<Registry>> = OnceLock::new();
    REGS.get_or_init(|| {
        let g = family_gpu(&FAMILIES).unwrap();
        VARIANTS
            .iter()
            .map(|(d, _)| {
                let cache = KernelCache::disabled()
                    .with_defines(&[d.to_string()])
                    .unwrap();
                Registry::load_families(&g.ctx, &[&fast_attention::SOURCE], &cache)
                    .unwrap_or_else(|e| panic!("{d}: {e}"))
            })
            .collect()
    })
}

/// What each of `run`'s fast outputs is: [`PATHS`], then [`VARIANTS`].
fn run_labels() -> Vec<String> {
    PATHS
        .iter()
        .map(|p| format!("{p:?}"))
        .chain(VARIANTS.iter().flat_map(|(d, paths)| {
            paths
                .iter()
                .map(move |p| format!("({p:?}, Cluster) with {d}"))
        }))
        .collect()
}

/// A fast kernel's output from two runs of the same batch.
type TwoRuns = (Vec<f32>, Vec<f32>);

/// Runs the reference and each fast kernel of [`PATHS`], then each of `variants` ([`VARIANTS`]),
/// twice on `b`; returns the reference and, per run ([`run_labels`]), (fast, fast again).
fn run(
    attn: &Attention,
    fast: &FastAttention,
    variants: &[FastAttention],
    st: &State,
    b: &Batch,
    s: BorrowedStream,
) -> (Vec<f32>, Vec<TwoRuns>) {
    let g = family_gpu(&FAMILIES).unwrap();
    let t = b.t();
    let [po, pml] = workspace_floats(H, HD);
    let sizes = [
        st.ring.len(),
        st.entries.len().max(4),
        st.table.len().max(1) * 4,
        t * 4,
        b.layout.query_start.len() * 4,
        b.layout.seq_slots.len() * 4,
        t * 4,
        t * H * HD * 4,
        t * HD * 4,
        t * TOPK * 4,
        t * 4,
        H * 4,
        t * H * HD * 4,
        po * 4,
        pml * 4,
        t * fast_attention::staged_row_bytes(HD, NOPE),
        t * fast_attention::q_bf16_bytes(H, HD),
        t * fast_attention::q_bf16_bytes(H, HD),
    ];
    let (_arena, p) = alloc(&g.ctx, &sizes);
    let up = |d: DevicePtr, v: &[u8]| arena::copy_to_device_sync(d, v, s).unwrap();
    up(p[0], &st.ring);
    if !st.entries.is_empty() {
        up(p[1], &st.entries);
        arena::copy_to_device_sync(p[2], &st.table, s).unwrap();
    }
    for (d, v) in [
        (p[3], &b.layout.positions),
        (p[4], &b.layout.query_start),
        (p[5], &b.layout.seq_slots),
        (p[6], &b.layout.seq_of),
        (p[9], &b.selected),
        (p[10], &b.nsel),
    ] {
        arena::copy_to_device_sync(d, v, s).unwrap();
    }
    for (d, v) in [(p[7], &b.q), (p[8], &b.kv), (p[11], &b.sinks)] {
        arena::copy_to_device_sync(d, v, s).unwrap();
    }
    // The queries' BF16 copy as the forward's head_prep writes it (the same values: b.q is BF16).
    let q16: Vec<u16> =
        b.q.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
    arena::copy_to_device_sync(p[17], &q16, s).unwrap();
    let meta = BatchMeta {
        positions: p[3],
        query_start: p[4],
        seq_slots: p[5],
        seq_of: p[6],
        num_tokens: t,
        num_seqs: b.layout.seq_slots.len(),
    };
    let ring = KvPagesDev {
        pool: p[0],
        table: None,
        pages_per_slot: KvRows::pages_for(W),
        rows: st.rows,
    };
    let entries = (st.ratio > 0).then_some(KvPagesDev {
        pool: p[1],
        table: Some(p[2]),
        pages_per_slot: st.pps(),
        rows: st.rows,
    });
    let mut args = AttentionArgs {
        q: p[7],
        q_bf16: None,
        kv: p[8],
        ring,
        entries,
        selected: st.csa.then_some((p[9], p[10])),
        sinks: p[11],
        heads: H,
        head_dim: HD,
        window: W,
        ratio: st.ratio,
        maxe: st.maxe,
        topk: TOPK,
        num_slots: SLOTS,
        official: true,
        o: p[12],
    };
    assert!(
        FastAttention::covers(&args)
            && FastAttention::covers_wgmma(&args)
            && FastAttention::covers_wgmma_ws(&args)
    );
    let ws = FastAttentionWorkspace {
        part_o: p[13],
        part_ml: p[14],
        staged: p[15],
        q_bf16: p[16],
    };
    let download = |d: DevicePtr| {
        let mut v = vec![0f32; t * H * HD];
        arena::copy_to_host_sync(&mut v, d, s).unwrap();
        v
    };
    let poison = || arena::memset_async(p[12], 0xff, s).unwrap();
    poison();
    attn.attention(&g.ctx, &meta, &args, s).unwrap();
    let o_ref = download(p[12]);
    let mut fast_runs = vec![];
    // Each path twice: from the caller's BF16 queries (the forward's form), then from the f32
    // ones, which the wrapper converts into the workspace (poisoned first): the same bits.
    let runs =
        PATHS
            .iter()
            .map(|&(path, combine)| (fast, path, combine))
            .chain(variants.iter().zip(VARIANTS).flat_map(|(v, (_, paths))| {
                paths.iter().map(move |&p| (v, p, SplitCombine::Cluster))
            }));
    for (kernels, path, combine) in runs {
        let mut once = |q_bf16: Option<DevicePtr>| {
            poison();
            arena::memset_async(p[16], 0xff, s).unwrap();
            args.q_bf16 = q_bf16;
            kernels
                .attention_split(path, None, combine, &g.ctx, &meta, &args, &ws, s)
                .unwrap();
            download(p[12])
        };
        let o_fast = once(Some(p[17]));
        let o_again = once(None);
        fast_runs.push((o_fast, o_again));
    }
    (o_ref, fast_runs)
}

/// Compares the fast output with the reference under the bound (tokens in parallel); returns
/// the largest |diff| / bound.
fn check(name: &str, st: &State, b: &Batch, o_ref: &[f32], o_fast: &[f32]) -> f64 {
    let t = b.t();
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(16);
    let worst = std::sync::Mutex::new((0.0f64, String::new()));
    let bad = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for w in 0..threads {
            let (worst, bad) = (&worst, &bad);
            sc.spawn(move || {
                let mut local = (0.0f64, 0, 0);
                for i in (w..t).step_by(threads) {
                    let bnd = bound(b, st, i, o_ref);
                    for (j, bd) in bnd.iter().enumerate() {
                        let (r, f) = (o_ref[i * H * HD + j], o_fast[i * H * HD + j]);
                        let d = (r as f64 - f as f64).abs();
                        if (d > *bd || f.is_nan() != r.is_nan())
                            && bad.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 5
                        {
                                println!(
                                    "MISMATCH {name}: token {i} head {} channel {}: fast {f:e}, reference {r:e}, bound {bd:e}",
                                    j / HD,
                                    j % HD
                                );
                        }
                        if d / bd > local.0 {
                            local = (d / bd, i, j);
                        }
                    }
                }
                let mut wst = worst.lock().unwrap();
                if local.0 > wst.0 {
                    let (r, i, j) = local;
                    *wst = (r, format!("token {i} head {} channel {}", j / HD, j % HD));
                }
            });
        }
    });
    let (ratio, at) = worst.into_inner().unwrap();
    let bad = bad.into_inner();
    let differ = o_ref
        .iter()
        .zip(o_fast)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    println!(
        "{name}: {t} tokens, {} splits: max |fast - ref| / bound = {ratio:.3} ({at}); {:.1}% of values differ from the reference",
        splits(t, W + if st.csa { TOPK } else { st.maxe }),
        100.0 * differ as f64 / o_ref.len() as f64
    );
    assert_eq!(
        bad, 0,
        "{name}: {bad} values outside the bound (MISMATCH lines above)"
    );
    ratio
}

/// Decode tokens (one per sequence) of `n` sequences over the slots at positions from `pos`.
fn decode(n: usize, pos: &[usize]) -> Vec<(i32, usize, usize)> {
    (0..n)
        .map(|i| ((i % SLOTS) as i32, pos[i % pos.len()] + i / SLOTS, 1))
        .collect()
}

fn run_layer(
    name: &str,
    ratio: usize,
    csa: bool,
    max_seq_len: usize,
    batches: &[Vec<(i32, usize, usize)>],
) {
    let _l = serial();
    let Some(g) = family_gpu(&FAMILIES) else {
        return;
    };
    print_kernel_resources(&g.reg);
    let attn = Attention::new(&g.reg).unwrap();
    let fast = FastAttention::new(&g.reg).unwrap();
    let variants: Vec<FastAttention> = variant_registries()
        .iter()
        .map(|r| FastAttention::new(r).unwrap())
        .collect();
    let labels = run_labels();
    let stream = OwnedStream::new(&g.ctx).unwrap();
    let s = stream.borrow();
    let _c = g.ctx.enter().unwrap();
    let mut rng = XorShift(0x5eed_0000 + ratio as u64 * 31 + max_seq_len as u64);
    let st = State::random(&mut rng, ratio, csa, max_seq_len);
    for (k, seqs) in batches.iter().enumerate() {
        let b = Batch::new(&mut rng, &st, seqs);
        let (o_ref, fast_runs) = run(&attn, &fast, &variants, &st, &b, s);
        // fast_attention.rs: the kernels (and the variants) give the same bits.
        for (path, (o_fast, _)) in labels.iter().zip(&fast_runs).skip(1) {
            let apart = fast_runs[0]
                .0
                .iter()
                .zip(o_fast)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            println!("{name} batch {k}: {path} differs from mma.sync in {apart} values");
            assert_eq!(
                apart, 0,
                "{name} batch {k}: the mma.sync and {path} kernels differ"
            );
        }
        for (path, (o_fast, o_again)) in labels.iter().zip(&fast_runs) {
            let tag = format!("{name} batch {k} {path}");
            check(&tag, &st, &b, &o_ref, o_fast);
            assert!(
                o_fast
                    .iter()
                    .zip(o_again)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{tag}: two runs differ (from the caller's BF16 queries, then converted by the wrapper)"
            );
            for (i, &sl) in b.layout.seq_of.iter().enumerate() {
                if b.layout.seq_slots[sl as usize] < 0 {
                    let row = &o_fast[i * H * HD..][..H * HD];
                    assert!(
                        row.iter().all(|v| v.to_bits() == 0),
                        "{tag}: padding token {i} not zero"
                    );
                }
            }
        }
    }
}

/// CSA at 64K positions: decode batches of 1, 8, 16 and 64 (early positions too: no selection, a
/// ring still filling; 64 tokens split 2 ways, combined in a cluster; 16 tokens 8 ways), a padding
/// sequence, a 300-token prefill chunk continuing a slot.
#[test]
fn csa_attention_matches_the_reference_within_the_bound() {
    let mut pre = vec![(1, 40_000, 200), (2, 0, 100)];
    pre.push((-1, 0, 4));
    run_layer(
        "CSA",
        4,
        true,
        65536,
        &[
            decode(1, &[65_000]),
            decode(8, &[2, 5, 150, 9_000, 30_000, 65_500]),
            decode(16, &[1_000, 33_000, 65_400]),
            decode(64, &[0, 60, 127, 128, 4_000, 16_000, 64_000]),
            pre,
        ],
    );
}

/// HCA at 256K positions (up to 2048 entries + the window): decode batches of 1, 8 and 64,
/// positions below the ratio (no entry yet), a 300-token prefill, and 72 tokens (unsplit blocks
/// of up to 68 key tiles beside blocks of one).
#[test]
fn hca_attention_matches_the_reference_within_the_bound() {
    run_layer(
        "HCA",
        128,
        false,
        262_144,
        &[
            decode(1, &[262_000]),
            decode(8, &[3, 127, 128, 1000, 100_000, 200_000]),
            decode(64, &[10, 500, 70_000, 262_100]),
            vec![(0, 5_000, 150), (1, 0, 150)],
            decode(72, &[10, 150_000, 262_100]),
        ],
    );
}

/// A window-only layer: decode batches and a prefill with padding.
#[test]
fn sliding_attention_matches_the_reference_within_the_bound() {
    run_layer(
        "sliding",
        0,
        false,
        4096,
        &[
            decode(1, &[4000]),
            decode(8, &[0, 1, 64, 127, 128, 3000]),
            vec![(0, 100, 290), (-1, 0, 10)],
        ],
    );
}
