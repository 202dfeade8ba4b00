//! GPU op test of the fast set's indexer (kernels/fast_indexer.cu) against the reference
//! indexer kernel (kernels/indexer.cu) on the same device state, at Flash shapes (64 heads of
//! 128, top-512, ratio 4; also heads of 64 and 256): decode batches of 1, 8 and 64 tokens at contexts up to 64K (up to
//! 16,250 visible keys), a 300-token prefill chunk, tokens with no key yet, fewer visible keys
//! than the top-k, padding. Keys are random official pages (e2m1 nibbles, UE8M0 scales) through
//! a scrambled block table; queries official FP4 values.
//!
//! Checks:
//! - the selection is EXACTLY the top min(topk, visible) of the fast kernel's own scores (ties
//!   to the lower index), against `reference::ops::top_k` on the host, listed in index order;
//! - every score is within the derived bound of the reference's: with D_h the exact q_h . k
//!   (computed here in f64) and A_h = Σ_c |q_hc k_c|, the fast d_h differs from the reference's
//!   by at most 2^-8 |D_h| (both round to BF16) + ε_h, ε_h = 2^-8 A_h + (DI/32 + 2) 2^-24 A_h
//!   (each 32-block's sum on the FP8 tensor core, whose accumulator keeps at least 13 bits of its
//!   largest term, so 32 terms err by at most 2^-8 of their absolute sum; then the f32 promotion
//!   of the DI/32 blocks); times |w_h| over the heads, the f32 head sum (HI + 2) 2^-24 Σ|D_h w_h|,
//!   and both final BF16 roundings: |s_f - s_r| <= (1 + 2^-8) [Σ_h |w_h| (2^-8 |D_h| + 1.01 ε_h)
//!   + (HI + 2) 2^-24 (1 + 2^-7) Σ_h |D_h w_h|] + 2^-8 |s_r|;
//! - with the head sum on the tensor core (`HeadSum::TensorCore`: the relu'd bf16 d_h against w
//!   split into bf16 hi + lo, |w - hi - lo| <= 2^-18 |w|; each column's 64 exact products added in
//!   f32 by the tensor core, allowed one f32 ulp an add (truncating adders), then hi + lo in f32)
//!   the head sum's term is ((HI + 2) 2^-23 (1 + 2^-8) + 2^-18 + 2^-24) (1 + 2^-7) Σ_h |D_h w_h|
//!   in place of (HI + 2) 2^-24 (1 + 2^-7) Σ_h |D_h w_h|;
//! - with the scales folded (`SelectPlan::fold`: a key's dot with a head c chains of DI/32/c
//!   wgmmas on the FP8 tensor core, each adding 32 exact products to the incoming sum, every one
//!   of the 33 inputs allowed 2^-13 of the largest, at most A_h, the chains then added in f32;
//!   the powers of two moved into the weight and the score are exact) ε_h = ((DI/32/c) 33 2^-13 +
//!   (DI/32 + 2) 2^-24) A_h: at DI = 128, 4x the per-block bound with one chain
//!   (`ScaleFold::Chain128`; DESIGN.md §4 allows promotion every 128 of K), 2x with two
//!   (`ScaleFold::Chain64`). Tiles and tokens that do not fold take the per-block promotion,
//!   inside the same bound;
//! - the streamed kernel (`SelectPlan::streamed`) is the fold with one chain and the tensor-core
//!   head sum, inside the same bound (its k32 steps group the products otherwise);
//! - the selected sets equal the reference's wherever the margin exceeds that rounding: an
//!   entry selected by one and not the other has a reference score within 2 B (B the token's
//!   largest bound) of the reference's k-th score;
//! - nsel equal, reruns bit-identical, padding and tokens without keys select nothing.
//!
//! Without a CUDA device the GPU tests print `skipped: no CUDA device`.

mod common;

use common::gpu::{alloc, assert_families_compile, family_gpu, print_kernel_resources};
use common::kv::{BatchLayout, scrambled_table};
use common::rng::XorShift;
use dsv4::cuda::arena;
use dsv4::cuda::kernels::attention::BatchMeta;
use dsv4::cuda::kernels::fast_indexer::{
    self, FastIndexer, FusedTopk, HeadSum, ScaleFold, SelectPart, SelectPlan,
};
use dsv4::cuda::kernels::indexer::{self, Indexer, IndexerArgs};
use dsv4::cuda::kv_pages::{KV_PAGE, KvFormat, KvPagesDev, KvRows};
use dsv4::cuda::registry::KernelSource;
use dsv4::cuda::{Arena, BorrowedStream, Context, DevicePtr, OwnedStream};
use dsv4::reference::ops::top_k;
use dsv4::weights::dtype::{FP4_LUT, e8m0_to_f32};
use std::sync::Mutex;

const FAMILIES: [&KernelSource; 2] = [&indexer::SOURCE, &fast_indexer::SOURCE];

static SERIAL: Mutex<()> = Mutex::new(());

const HI: usize = 64;
const DI: usize = 128;
const TOPK: usize = 512;
const RATIO: usize = 4;
const SLOTS: usize = 3;
const MAX_SEQ_LEN: usize = 65536;
const MAXE: usize = MAX_SEQ_LEN / RATIO;

#[test]
fn families_compile_for_sm_90a() {
    assert_families_compile(&FAMILIES);
}

/// Random official key pages (any e2m1 nibble, scales 2^-7 .. 2^-1) and a scrambled table.
struct Keys {
    di: usize,
    rows: KvRows,
    pool: Vec<u8>,
    table: Vec<i32>,
}

impl Keys {
    fn random(rng: &mut XorShift, di: usize) -> Keys {
        Keys::from_patterns(rng, None, di)
    }

    /// Random keys of which about one in `every` cannot take the scale fold: its 32-block
    /// exponents span more than 11 octaves (a block at 2^-27), or its largest lies outside the
    /// fold's [96, 160] (all blocks at 2^-36 .. 2^-34, or at 2^38), so tiles of both kinds meet.
    fn with_unfoldable(rng: &mut XorShift, di: usize, every: u64) -> Keys {
        let mut k = Keys::random(rng, di);
        let (rb, pb) = (k.rows.scale_bytes(), k.rows.page_bytes());
        for page in k.pool.chunks_exact_mut(pb) {
            for r in 0..KV_PAGE {
                let sc = &mut page[KV_PAGE * k.rows.row_bytes() + r * rb..][..di / 32];
                match rng.below(every) {
                    0 => sc[rng.below(sc.len() as u64) as usize] = 100,
                    1 => sc.iter_mut().for_each(|v| *v = 91 + rng.below(3) as u8),
                    2 => sc.iter_mut().for_each(|v| *v = 165),
                    _ => {}
                }
            }
        }
        k
    }

    /// Every key row a copy of one of `patterns` random rows (None: every row its own), so a
    /// token's scores tie in `patterns` values at most: the selection's ties to the lower index
    /// decide nearly everything.
    fn from_patterns(rng: &mut XorShift, patterns: Option<usize>, di: usize) -> Keys {
        let rows = KvRows::index_keys(KvFormat::Official, di);
        let pps = KvRows::pages_for(MAXE);
        let n = SLOTS * pps;
        let random_row = |rng: &mut XorShift| -> (Vec<u8>, Vec<u8>) {
            let codes = (0..di / 2).map(|_| rng.below(256) as u8).collect();
            let scales = (0..di / 32).map(|_| 120 + rng.below(7) as u8).collect();
            (codes, scales)
        };
        let fixed: Vec<_> = (0..patterns.unwrap_or(0))
            .map(|_| random_row(rng))
            .collect();
        let mut pool = vec![0u8; n * rows.page_bytes()];
        for page in pool.chunks_exact_mut(rows.page_bytes()) {
            for r in 0..KV_PAGE {
                let (codes, scales) = if fixed.is_empty() {
                    random_row(rng)
                } else {
                    fixed[rng.below(fixed.len() as u64) as usize].clone()
                };
                page[r * rows.row_bytes()..][..di / 2].copy_from_slice(&codes);
                let sc = KV_PAGE * rows.row_bytes() + r * rows.scale_bytes();
                page[sc..sc + di / 32].copy_from_slice(&scales);
            }
        }
        Keys {
            di,
            rows,
            pool,
            table: scrambled_table(n),
        }
    }

    fn key(&self, slot: usize, e: usize) -> Vec<f32> {
        let pb = self.rows.page_bytes();
        let page = self.table[slot * KvRows::pages_for(MAXE) + e / KV_PAGE] as usize;
        self.rows
            .decode_row(&self.pool[page * pb..][..pb], e % KV_PAGE)
    }
}

/// A batch: its layout and inputs.
struct Batch {
    layout: BatchLayout,
    di: usize,
    /// Index heads (HI, but fewer where the reference's shared memory cannot hold HI of `di`).
    hi: usize,
    qi: Vec<f32>,
    iw: Vec<f32>,
}

impl Batch {
    fn new(rng: &mut XorShift, seqs: &[(i32, usize, usize)], di: usize) -> Batch {
        Batch::with_heads(rng, seqs, di, HI)
    }

    fn with_heads(rng: &mut XorShift, seqs: &[(i32, usize, usize)], di: usize, hi: usize) -> Batch {
        let mut b = Batch {
            layout: BatchLayout::new(seqs),
            di,
            hi,
            qi: vec![],
            iw: vec![],
        };
        let t = b.layout.tokens();
        // Official queries: e2m1 values times a power of two per 32 channels.
        b.qi = (0..t * hi * di / 32)
            .flat_map(|_| {
                let s = e8m0_to_f32(122 + rng.below(5) as u8);
                (0..32)
                    .map(|_| FP4_LUT[rng.below(16) as usize] * s)
                    .collect::<Vec<_>>()
            })
            .collect();
        let scale = 1.0 / ((di * hi) as f32).sqrt();
        b.iw = rng
            .vec(t * hi, 1.0, true)
            .iter()
            .map(|v| v * scale)
            .collect();
        b
    }

    fn t(&self) -> usize {
        self.layout.tokens()
    }

    /// Makes some tokens' queries unable to take the scale fold: one 32-block of a head scaled by
    /// 2^-20 (its values stay official FP4 values; the head then spans more than 11 octaves), a
    /// weight of 2^-40 (outside the fold's 2^+-32), and a zero weight (which folds).
    fn with_unfoldable_tokens(mut self) -> Batch {
        let (hi, di) = (self.hi, self.di);
        let t = self.t();
        for i in (0..t).step_by(5) {
            let h = (7 * i) % hi;
            let blk = i % (di / 32);
            for v in &mut self.qi[(i * hi + h) * di + 32 * blk..][..32] {
                *v *= 2f32.powi(-20);
            }
        }
        for i in (1..t).step_by(5) {
            self.iw[i * hi + (3 * i) % hi] = 2f32.powi(-40);
        }
        for i in (2..t).step_by(5) {
            self.iw[i * hi + (5 * i) % hi] = 0.0;
        }
        self
    }

    /// Token i's slot and visible key count (None: padding).
    fn visible(&self, i: usize) -> Option<(usize, usize)> {
        let slot = self.layout.seq_slots[self.layout.seq_of[i] as usize];
        (slot >= 0).then(|| {
            let v = ((self.layout.positions[i] as usize + 1) / RATIO).min(MAXE);
            (slot as usize, v)
        })
    }
}

/// How a fast run's scores were rounded: its head sum, and whether its scales were folded.
#[derive(Clone, Copy, Debug)]
struct Rounding {
    head_sum: HeadSum,
    fold: ScaleFold,
}

const ORDERED: Rounding = Rounding {
    head_sum: HeadSum::Ordered,
    fold: ScaleFold::Off,
};
const TENSOR_CORE: Rounding = Rounding {
    head_sum: HeadSum::TensorCore,
    fold: ScaleFold::Off,
};

/// The derived bound (module doc) of each of token i's visible scores, for the fast kernel's
/// rounding `how`.
fn bounds(b: &Batch, keys: &Keys, i: usize, s_ref: &[f32], how: Rounding) -> Vec<f64> {
    let Some((slot, visible)) = b.visible(i) else {
        return vec![];
    };
    let u = 2f64.powi(-8);
    let (di, hi) = (b.di, b.hi);
    (0..visible)
        .map(|e| {
            let k = keys.key(slot, e);
            let (mut per_head, mut dw) = (0.0f64, 0.0f64);
            for h in 0..hi {
                let q = &b.qi[(i * hi + h) * di..][..di];
                let (mut d, mut a) = (0.0f64, 0.0f64);
                for c in 0..di {
                    let p = q[c] as f64 * k[c] as f64;
                    d += p;
                    a += p.abs();
                }
                let blocks = di as f64 / 32.0;
                let eps = if how.fold != ScaleFold::Off {
                    // Chains of DI/32/c wgmmas: 32 products and the incoming sum each.
                    let chain = blocks / how.fold.chains() as f64;
                    (chain * 33.0 * 2f64.powi(-13) + (blocks + 2.0) * 2f64.powi(-24)) * a
                } else {
                    (2f64.powi(-8) + (blocks + 2.0) * 2f64.powi(-24)) * a
                };
                let w = (b.iw[i * hi + h] as f64).abs();
                per_head += w * (u * d.abs() + 1.01 * eps);
                dw += (d * w).abs();
            }
            let per_add = match how.head_sum {
                HeadSum::Ordered => (hi as f64 + 2.0) * 2f64.powi(-24),
                HeadSum::TensorCore => {
                    (hi as f64 + 2.0) * 2f64.powi(-23) * (1.0 + u) + 2f64.powi(-18) + 2f64.powi(-24)
                }
            };
            let sum = per_add * (1.0 + 2.0 * u) * dw;
            (1.0 + u) * (per_head + sum) + u * (s_ref[e] as f64).abs() + 1e-30
        })
        .collect()
}

struct Run {
    scores: Vec<f32>,
    selected: Vec<i32>,
    nsel: Vec<i32>,
}

/// The batch's keys, queries and layout on the device, and the indexer's outputs (scores,
/// selection, counts: p[8], p[9], p[10]); the arena holds them.
fn device_inputs(
    ctx: &Context,
    keys: &Keys,
    b: &Batch,
    s: BorrowedStream,
) -> (Arena, Vec<DevicePtr>, BatchMeta, IndexerArgs) {
    assert_eq!(keys.di, b.di, "keys and queries of one head dim");
    let t = b.t();
    let sizes = [
        keys.pool.len(),
        keys.table.len() * 4,
        t * 4,
        b.layout.query_start.len() * 4,
        b.layout.seq_slots.len() * 4,
        t * 4,
        t * b.hi * b.di * 4,
        t * b.hi * 4,
        t * MAXE * 4,
        t * TOPK * 4,
        t * 4,
    ];
    let (arena, p) = alloc(ctx, &sizes);
    arena::copy_to_device_sync(p[0], &keys.pool, s).unwrap();
    arena::copy_to_device_sync(p[1], &keys.table, s).unwrap();
    for (d, v) in [
        (p[2], &b.layout.positions),
        (p[3], &b.layout.query_start),
        (p[4], &b.layout.seq_slots),
        (p[5], &b.layout.seq_of),
    ] {
        arena::copy_to_device_sync(d, v, s).unwrap();
    }
    arena::copy_to_device_sync(p[6], &b.qi, s).unwrap();
    arena::copy_to_device_sync(p[7], &b.iw, s).unwrap();
    let meta = BatchMeta {
        positions: p[2],
        query_start: p[3],
        seq_slots: p[4],
        seq_of: p[5],
        num_tokens: t,
        num_seqs: b.layout.seq_slots.len(),
    };
    let args = IndexerArgs {
        qi: p[6],
        iw: p[7],
        ikeys: KvPagesDev {
            pool: p[0],
            table: Some(p[1]),
            pages_per_slot: KvRows::pages_for(MAXE),
            rows: keys.rows,
        },
        heads: b.hi,
        dim: b.di,
        ratio: RATIO,
        topk: TOPK,
        maxe: MAXE,
        num_slots: SLOTS,
        official: true,
        scores: p[8],
        selected: p[9],
        nsel: p[10],
    };
    (arena, p, meta, args)
}

/// The error `select_with` gives for `plan` on the batch (it must refuse it).
fn refused(
    ctx: &Context,
    fast: &FastIndexer,
    keys: &Keys,
    b: &Batch,
    plan: SelectPlan,
    s: BorrowedStream,
) -> String {
    let (_arena, _p, meta, args) = device_inputs(ctx, keys, b, s);
    match fast.select_with(ctx, &meta, &args, plan, s) {
        Ok(()) => panic!("{plan:?} was run"),
        Err(e) => e.to_string(),
    }
}

/// The plain scoring kernel (`fi_score_kernel`: per-32-block promotion, the ordered head sum) at
/// the fast set's chunk size for `t` tokens: what the tests below the fold's check.
fn plain(t: usize) -> SelectPlan {
    SelectPlan {
        chunk_keys: fast_indexer::chunk_keys_for(t, MAXE),
        stage_keys: fast_indexer::stage_keys_for(MAXE, fast_indexer::TOPK_CLUSTER),
        head_sum: HeadSum::Ordered,
        fold: ScaleFold::Off,
        chunks_per_block: 1,
        streamed: false,
        fused_topk: None,
        topk_cluster: fast_indexer::TOPK_CLUSTER,
    }
}

/// Runs the reference indexer, then the plain fast kernel twice; returns the three results.
fn run(
    reference: &Indexer,
    fast: &FastIndexer,
    keys: &Keys,
    b: &Batch,
    s: BorrowedStream,
) -> [Run; 3] {
    let plan = Some(plain(b.t()));
    let (r, mut f) = run_plans(reference, fast, keys, b, s, &[plan, plan]);
    let again = f.pop().unwrap();
    [r, f.pop().unwrap(), again]
}

/// Runs the reference indexer, then the fast one once per plan (None: `select`'s own); returns
/// the reference's result and the fast ones in order.
fn run_plans(
    reference: &Indexer,
    fast: &FastIndexer,
    keys: &Keys,
    b: &Batch,
    s: BorrowedStream,
    plans: &[Option<SelectPlan>],
) -> (Run, Vec<Run>) {
    let g = family_gpu(&FAMILIES).unwrap();
    let t = b.t();
    let (_arena, p, meta, args) = device_inputs(&g.ctx, keys, b, s);
    assert!(FastIndexer::covers(&args));
    let result = || read_run(&p, t, s);
    let poison = || poison_outputs(&p[8..], s);
    poison();
    reference.select(&g.ctx, &meta, &args, s).unwrap();
    let r = result();
    let fast_runs = plans
        .iter()
        .map(|plan| {
            poison();
            match plan {
                None => fast.select(&g.ctx, &meta, &args, s).unwrap(),
                Some(p) => fast.select_with(&g.ctx, &meta, &args, *p, s).unwrap(),
            }
            result()
        })
        .collect();
    (r, fast_runs)
}

/// The indexer's outputs of `t` tokens as device_inputs placed them (p[8], p[9], p[10]).
fn read_run(p: &[DevicePtr], t: usize, s: BorrowedStream) -> Run {
    let get = |d: DevicePtr, n: usize| -> Vec<u32> {
        let mut v = vec![0u32; n];
        arena::copy_to_host_sync(&mut v, d, s).unwrap();
        v
    };
    Run {
        scores: get(p[8], t * MAXE)
            .into_iter()
            .map(f32::from_bits)
            .collect(),
        selected: get(p[9], t * TOPK).into_iter().map(|v| v as i32).collect(),
        nsel: get(p[10], t).into_iter().map(|v| v as i32).collect(),
    }
}

/// Every byte of the buffers `outputs` set to 0xff (NaN scores, selections and counts of -1).
fn poison_outputs(outputs: &[DevicePtr], s: BorrowedStream) {
    for &d in outputs {
        arena::memset_async(d, 0xff, s).unwrap();
    }
}

/// All checks of one batch (module doc), tokens in parallel, `f` rounded as `how`; returns
/// (largest |diff| / bound, selections that differ from the reference's).
fn check(name: &str, keys: &Keys, b: &Batch, r: &Run, f: &Run, how: Rounding) -> (f64, usize) {
    let t = b.t();
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(16);
    let out = Mutex::new((0.0f64, 0usize, Vec::<String>::new()));
    std::thread::scope(|sc| {
        for w in 0..threads {
            let out = &out;
            sc.spawn(move || {
                let (mut worst, mut swaps, mut errors) = (0.0f64, 0usize, vec![]);
                for i in (w..t).step_by(threads) {
                    let sel_f = &f.selected[i * TOPK..][..TOPK];
                    let sel_r = &r.selected[i * TOPK..][..TOPK];
                    let Some((_, visible)) = b.visible(i) else {
                        if f.nsel[i] != 0 || sel_f.iter().any(|&e| e != -1) {
                            errors.push(format!("padding token {i} selects something"));
                        }
                        continue;
                    };
                    let k = TOPK.min(visible);
                    if f.nsel[i] != k as i32 || r.nsel[i] != k as i32 {
                        errors.push(format!("token {i}: nsel {} / {} for {k}", f.nsel[i], r.nsel[i]));
                        continue;
                    }
                    // Exact top-k of the fast scores, listed in index order.
                    let sf = &f.scores[i * MAXE..][..visible];
                    let mut want: Vec<i32> = top_k(sf, k).into_iter().map(|e| e as i32).collect();
                    want.sort_unstable();
                    want.resize(TOPK, -1);
                    if want != sel_f {
                        errors.push(format!("token {i}: the selection is not the top-{k} of its scores"));
                    }
                    // Scores within the bound.
                    let sr = &r.scores[i * MAXE..][..visible];
                    let bnd = bounds(b, keys, i, sr, how);
                    let mut big = 0.0f64;
                    for e in 0..visible {
                        let d = (sf[e] as f64 - sr[e] as f64).abs();
                        big = big.max(bnd[e]);
                        if d > bnd[e] {
                            errors.push(format!(
                                "token {i} entry {e}: fast {:e} reference {:e} bound {:e}",
                                sf[e], sr[e], bnd[e]
                            ));
                        }
                        worst = worst.max(d / bnd[e]);
                    }
                    // Selections: equal but within the rounding of the k-th score.
                    if k > 0 {
                        let kth = sr[sel_r[k - 1] as usize] as f64;
                        let in_r: std::collections::HashSet<i32> = sel_r[..k].iter().copied().collect();
                        let in_f: std::collections::HashSet<i32> = sel_f[..k].iter().copied().collect();
                        for &e in in_r.symmetric_difference(&in_f) {
                            swaps += 1;
                            let gap = (sr[e as usize] as f64 - kth).abs();
                            if gap > 2.0 * big {
                                errors.push(format!(
                                    "token {i}: entry {e} selected by one indexer only, {gap:e} from the k-th score (bound {:e})",
                                    2.0 * big
                                ));
                            }
                        }
                    }
                }
                let mut o = out.lock().unwrap();
                o.0 = o.0.max(worst);
                o.1 += swaps;
                o.2.extend(errors);
            });
        }
    });
    let (worst, swaps, errors) = out.into_inner().unwrap();
    let differ = (0..t)
        .filter_map(|i| b.visible(i).map(|(_, v)| (i, v)))
        .map(|(i, v)| {
            (0..v)
                .filter(|&e| f.scores[i * MAXE + e].to_bits() != r.scores[i * MAXE + e].to_bits())
                .count()
        })
        .sum::<usize>();
    println!(
        "{name}: {t} tokens: max |fast - ref| / bound = {worst:.3}; {differ} scores differ from the reference; {swaps} selected entries differ"
    );
    for e in errors.iter().take(8) {
        println!("MISMATCH {name}: {e}");
    }
    assert!(
        errors.is_empty(),
        "{name}: {} failures (MISMATCH lines above)",
        errors.len()
    );
    (worst, swaps)
}

/// Asserts that the runs `f` of all of `plans` but the last gave the first one's result, bit for
/// bit (the last is another kernel, compared by the caller).
fn assert_all_but_last_alike(name: &str, plans: &[Option<SelectPlan>], f: &[Run]) {
    let alike = plans.len() - 1;
    for (p, run) in plans[..alike].iter().zip(f).skip(1) {
        assert!(
            same_result(run, &f[0]),
            "{name}: {p:?} differs from {:?}",
            plans[0]
        );
    }
}

/// At the other head dims ([`OTHER_DIMS`]) a fold plan (`plan_for(tokens)`) runs the plain kernel
/// of its head sum: that kernel's result (its plan without the fold, one chunk a block), within
/// its bound of the reference's.
fn other_dims_run_the_plain_kernel(
    reference: &Indexer,
    fast: &FastIndexer,
    s: BorrowedStream,
    rng: &mut XorShift,
    label: &str,
    plan_for: &dyn Fn(usize) -> SelectPlan,
) {
    for (di, hi) in OTHER_DIMS {
        let keys = Keys::random(rng, di);
        let b = other_dims_batch(rng, di, hi);
        let own = plan_for(b.t());
        let plain = SelectPlan {
            fold: ScaleFold::Off,
            chunks_per_block: 1,
            streamed: false,
            fused_topk: None,
            topk_cluster: fast_indexer::TOPK_CLUSTER,
            ..own
        };
        let (r, f) = run_plans(reference, fast, &keys, &b, s, &[Some(own), Some(plain)]);
        let name = format!("{label}, {hi} heads of {di}");
        let how = Rounding {
            head_sum: own.head_sum,
            fold: ScaleFold::Off,
        };
        check(&name, &keys, &b, &r, &f[0], how);
        assert!(
            same_result(&f[0], &f[1]),
            "{name}: not the plain kernel's result"
        );
    }
}

/// How many scores two runs gave different bits.
fn scores_differing(a: &Run, b: &Run) -> usize {
    a.scores
        .iter()
        .zip(&b.scores)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// `check` on the Flash batches over fresh random keys, then (with `unfoldable`) over keys and
/// tokens of which some cannot take the scale fold; each batch named after `label`.
fn fold_batches(
    rng: &mut XorShift,
    label: &str,
    unfoldable: bool,
    check: &dyn Fn(&str, &Keys, &Batch),
) {
    let keys = Keys::random(rng, DI);
    for (k, seqs) in flash_batches().iter().enumerate() {
        let b = Batch::new(rng, seqs, DI);
        check(&format!("{label}batch {k}"), &keys, &b);
    }
    if !unfoldable {
        return;
    }
    let keys = Keys::with_unfoldable(rng, DI, 300);
    for (k, seqs) in flash_batches().iter().enumerate() {
        let b = Batch::new(rng, seqs, DI).with_unfoldable_tokens();
        check(
            &format!("{label}some keys and tokens unfoldable, batch {k}"),
            &keys,
            &b,
        );
    }
}

/// Whether two runs gave the same scores (bit for bit), selection and counts.
fn same_result(a: &Run, b: &Run) -> bool {
    a.scores
        .iter()
        .zip(&b.scores)
        .all(|(x, y)| x.to_bits() == y.to_bits())
        && a.selected == b.selected
        && a.nsel == b.nsel
}

/// Runs a batch (`run`), checks the fast result against the reference's (`check`) and that the
/// fast indexer's two runs are bit-identical.
fn check_against_reference(
    reference: &Indexer,
    fast: &FastIndexer,
    keys: &Keys,
    b: &Batch,
    s: BorrowedStream,
    name: &str,
) {
    let [r, f, again] = run(reference, fast, keys, b, s);
    check(name, keys, b, &r, &f, ORDERED);
    assert!(same_result(&f, &again), "{name}: two runs differ");
}

/// Runs `f` with the reference and fast indexers and a stream, the GPU's context current and the
/// tests serialized; returns without calling it when there is no CUDA device (`family_gpu` says
/// so).
fn with_indexers(f: impl FnOnce(&Indexer, &FastIndexer, BorrowedStream)) {
    let _l = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(g) = family_gpu(&FAMILIES) else {
        return;
    };
    let reference = Indexer::new(&g.reg).unwrap();
    let fast = FastIndexer::new(&g.reg).unwrap();
    let stream = OwnedStream::new(&g.ctx).unwrap();
    let _c = g.ctx.enter().unwrap();
    f(&reference, &fast, stream.borrow());
}

fn decode(n: usize, pos: &[usize]) -> Vec<(i32, usize, usize)> {
    (0..n)
        .map(|i| ((i % SLOTS) as i32, pos[i % pos.len()] + i / SLOTS, 1))
        .collect()
}

#[test]
fn tied_scores_select_the_lowest_indices() {
    with_indexers(|reference, fast, s| {
        let mut rng = XorShift(0x7135_5eed);
        // One pattern: every score of a token equal (the top-k is its first k entries); three: the
        // k-th score's ties straddle the selection boundary.
        for patterns in [1, 3] {
            let keys = Keys::from_patterns(&mut rng, Some(patterns), DI);
            let seqs = decode(8, &[3, 700, 2047, 2048, 2049, 5000, 30_000, 65_535]);
            let b = Batch::new(&mut rng, &seqs, DI);
            let [r, f, again] = run(reference, fast, &keys, &b, s);
            let name = format!("{patterns} key pattern(s)");
            check(&name, &keys, &b, &r, &f, ORDERED);
            assert!(
                f.selected == again.selected,
                "{name}: two runs select differently"
            );
        }
    });
}

/// Flash-shaped batches: decode at 1, 8 and 64 tokens (contexts up to 64K, one token with nothing
/// visible yet), and a 150-token prefill chunk of two sequences beside padding.
fn flash_batches() -> [Vec<(i32, usize, usize)>; 4] {
    [
        decode(1, &[65_000]),
        decode(8, &[0, 2, 3, 700, 2047, 2048, 30_000, 65_535]),
        decode(64, &[5, 100, 1500, 2100, 8000]),
        vec![(1, 1000, 150), (2, 0, 150), (-1, 0, 4)],
    ]
}

/// The other head dims the fast kernel covers, with the heads the reference kernel's shared
/// memory takes at each (see `other_index_head_dims_match_the_reference`).
const OTHER_DIMS: [(usize, usize); 3] = [(32, HI), (64, HI), (fast_indexer::MAX_DIM, HI / 4)];

/// A decode batch of 8 tokens (nothing visible yet to 3000 keys) at another head dim.
fn other_dims_batch(rng: &mut XorShift, di: usize, hi: usize) -> Batch {
    let seqs = decode(8, &[0, 3, 700, 2047, 2048, 5000, 9000, 12_000]);
    Batch::with_heads(rng, &seqs, di, hi)
}

#[test]
fn fast_indexer_matches_the_reference_within_the_bound() {
    with_indexers(|reference, fast, s| {
        print_kernel_resources(&family_gpu(&FAMILIES).unwrap().reg);
        let mut rng = XorShift(0x1d3_5eed);
        let keys = Keys::random(&mut rng, DI);
        let batches = flash_batches();
        for (k, seqs) in batches.iter().enumerate() {
            let b = Batch::new(&mut rng, seqs, DI);
            check_against_reference(reference, fast, &keys, &b, s, &format!("batch {k}"));
        }
    });
}

#[test]
fn every_work_split_gives_the_same_result() {
    with_indexers(|reference, fast, s| {
        let mut rng = XorShift(0x5b1_17ed);
        let keys = Keys::random(&mut rng, DI);
        // Tokens from nothing visible to 16K entries (a top-k block's run: up to 2048 entries
        // in a cluster of 8, all of them in a cluster of 1). With 300 staged keys a block, the
        // top-k blocks of some tokens stage their keys and the others read the scores in every
        // pass; with 0 or 16, none stages. The top-k's cluster: 8, 2, 4, 8, 1 blocks a token.
        let seqs = decode(8, &[2, 700, 2047, 5000, 11_999, 12_003, 30_000, 65_535]);
        let b = Batch::new(&mut rng, &seqs, DI);
        let all = |cluster| fast_indexer::stage_keys_for(MAXE, cluster);
        let splits = [
            (64, 0, 8),
            (128, 300, 2),
            (192, 16, 4),
            (256, all(8), 8),
            (256, all(1), 1),
        ];
        let plans: Vec<Option<SelectPlan>> = splits
            .iter()
            .map(|&(chunk_keys, stage_keys, topk_cluster)| {
                Some(SelectPlan {
                    chunk_keys,
                    stage_keys,
                    head_sum: HeadSum::Ordered,
                    fold: ScaleFold::Off,
                    chunks_per_block: 1,
                    streamed: false,
                    fused_topk: None,
                    topk_cluster,
                })
            })
            .chain([Some(plain(b.t()))])
            .collect();
        let (r, f) = run_plans(reference, fast, &keys, &b, s, &plans);
        for (plan, run) in plans.iter().zip(&f) {
            let name = format!("{plan:?}");
            check(&name, &keys, &b, &r, run, ORDERED);
            assert!(
                same_result(run, &f[0]),
                "{name}: differs from {:?}",
                plans[0]
            );
        }
    });
}

/// The scoring and the top-k launched apart (`select_part`, as `dsv4 bench attn` times them)
/// give the whole select's bits: the scoring alone writes the scores row and leaves the
/// selection (poisoned) alone, the top-k alone selects on that row. A fused plan runs only
/// whole.
#[test]
fn the_launches_apart_give_the_whole_select() {
    with_indexers(|_reference, fast, s| {
        let mut rng = XorShift(0x5e1_ec75);
        let keys = Keys::random(&mut rng, DI);
        let seqs = decode(8, &[2, 700, 2047, 5000, 11_999, 12_003, 30_000, 65_535]);
        let b = Batch::new(&mut rng, &seqs, DI);
        let g = family_gpu(&FAMILIES).unwrap();
        let (_arena, p, meta, args) = device_inputs(&g.ctx, &keys, &b, s);
        let t = b.t();
        for topk_cluster in [1, 2, fast_indexer::TOPK_CLUSTER] {
            let plan = SelectPlan {
                topk_cluster,
                stage_keys: fast_indexer::stage_keys_for(MAXE, topk_cluster),
                ..fast_indexer::select_plan(t, MAXE)
            };
            let name = format!("{plan:?}");
            poison_outputs(&p[8..], s);
            fast.select_with(&g.ctx, &meta, &args, plan, s).unwrap();
            let whole = read_run(&p, t, s);
            poison_outputs(&p[8..], s);
            fast.select_part(&g.ctx, &meta, &args, plan, SelectPart::Scoring, s)
                .unwrap();
            let scored = read_run(&p, t, s);
            let scores_same = scored
                .scores
                .iter()
                .zip(&whole.scores)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(scores_same, "{name}: the scoring alone wrote other scores");
            assert!(
                scored.selected.iter().all(|&v| v == -1) && scored.nsel.iter().all(|&v| v == -1),
                "{name}: the scoring alone wrote a selection"
            );
            poison_outputs(&p[9..], s);
            fast.select_part(&g.ctx, &meta, &args, plan, SelectPart::TopK, s)
                .unwrap();
            let apart = read_run(&p, t, s);
            assert!(same_result(&apart, &whole), "{name}: apart != whole");
        }
        let fused = fast_indexer::fused_plan(t, MAXE, 8).expect("runs of 8 blocks fit");
        for part in [SelectPart::Scoring, SelectPart::TopK] {
            let err = fast
                .select_part(&g.ctx, &meta, &args, fused, part, s)
                .unwrap_err()
                .to_string();
            assert!(err.contains("out of range"), "{part:?} of {fused:?}: {err}");
        }
    });
}

#[test]
fn other_index_head_dims_match_the_reference() {
    with_indexers(|reference, fast, s| {
        let mut rng = XorShift(0xd1_5eed);
        // The other power-of-two head dims the config allows and the fast kernel covers: 32 (one
        // 32-block: an odd count, whose last wgmma round also multiplies the shared memory past the
        // operands and must leave it unused), 64 (four 16-value decode tasks a key) and the largest,
        // 256 (every decode register of a thread), at 16 heads: the reference kernel's shared memory
        // holds a token's queries and its per-head dots, and 64 or 32 heads of 256 do not fit its
        // 96 KB (169 KB, 101 KB).
        for (di, hi) in OTHER_DIMS {
            let keys = Keys::random(&mut rng, di);
            let batches = [
                decode(8, &[0, 3, 700, 2047, 2048, 5000, 9000, 12_000]),
                vec![(1, 1000, 150), (-1, 0, 4)],
            ];
            for (k, seqs) in batches.iter().enumerate() {
                let b = Batch::with_heads(&mut rng, seqs, di, hi);
                let name = format!("{hi} heads of {di}, batch {k}");
                check_against_reference(reference, fast, &keys, &b, s, &name);
            }
        }
    });
}

/// The head sum on the tensor core (`HeadSum::TensorCore`, `fi_score_tc_kernel`): its scores within
/// their bound (module doc) of the reference's and its selection the exact top-k of its own scores,
/// at Flash's shapes (decode batches of 1, 8 and 64 tokens, a prefill chunk, padding, nothing
/// visible yet), at every work split (the same bits: a key's sum does not depend on the chunk), at
/// head dims 32, 64 and 256, and with tied scores (equal keys sum alike); reruns bit-identical.
#[test]
fn tensor_core_head_sum_matches_the_reference_within_its_bound() {
    with_indexers(|reference, fast, s| {
        let mut rng = XorShift(0x7c_5eed);
        let plan = |chunk_keys, stage_keys| {
            Some(SelectPlan {
                chunk_keys,
                stage_keys,
                head_sum: HeadSum::TensorCore,
                fold: ScaleFold::Off,
                chunks_per_block: 1,
                streamed: false,
                fused_topk: None,
                topk_cluster: fast_indexer::TOPK_CLUSTER,
            })
        };
        let own = |t| {
            plan(
                fast_indexer::chunk_keys_for(t, MAXE),
                fast_indexer::stage_keys_for(MAXE, fast_indexer::TOPK_CLUSTER),
            )
        };
        let keys = Keys::random(&mut rng, DI);
        let batches = flash_batches();
        for (k, seqs) in batches.iter().enumerate() {
            let b = Batch::new(&mut rng, seqs, DI);
            let all = fast_indexer::stage_keys_for(MAXE, fast_indexer::TOPK_CLUSTER);
            // Its own split twice (reruns), then others.
            let plans = [
                own(b.t()),
                own(b.t()),
                plan(64, 0),
                plan(192, 16),
                plan(256, all),
            ];
            let (r, f) = run_plans(reference, fast, &keys, &b, s, &plans);
            let name = format!("tensor-core head sum, batch {k}");
            check(&name, &keys, &b, &r, &f[0], TENSOR_CORE);
            for (plan, run) in plans.iter().zip(&f).skip(1) {
                assert!(
                    same_result(run, &f[0]),
                    "{name}: {plan:?} differs from the fast set's split"
                );
            }
        }
        for (di, hi) in OTHER_DIMS {
            let keys = Keys::random(&mut rng, di);
            let b = other_dims_batch(&mut rng, di, hi);
            let (r, f) = run_plans(reference, fast, &keys, &b, s, &[own(b.t())]);
            let name = format!("tensor-core head sum, {hi} heads of {di}");
            check(&name, &keys, &b, &r, &f[0], TENSOR_CORE);
        }
        for patterns in [1, 3] {
            let keys = Keys::from_patterns(&mut rng, Some(patterns), DI);
            let seqs = decode(8, &[3, 700, 2047, 2048, 2049, 5000, 30_000, 65_535]);
            let b = Batch::new(&mut rng, &seqs, DI);
            let (r, f) = run_plans(reference, fast, &keys, &b, s, &[own(b.t())]);
            let name = format!("tensor-core head sum, {patterns} key pattern(s)");
            check(&name, &keys, &b, &r, &f[0], TENSOR_CORE);
        }
    });
}

/// The scale fold (`SelectPlan::fold`: fi_score_fold_kernel and fi_score_fold_tc_kernel, head dim
/// 128) with each head sum and each chain length: scores within the fold's bound (module doc) of
/// the reference's and the selection the exact top-k of its own scores, at Flash's shapes, with
/// tied scores, and with keys and tokens that cannot fold beside those that do (one chain of 128
/// with each head sum: the paths that differ), beside the plain kernel; every work split (chunk
/// sizes, chunks a block) gives the same bits, and reruns too. At head dims 32, 64 and 256 the
/// plan runs the plain kernels (their bits). Plans the kernels cannot run are refused.
#[test]
fn folded_scales_match_the_reference_within_their_bound() {
    with_indexers(|reference, fast, s| {
        let mut rng = XorShift(0xf01d_5eed);
        for (head_sum, fold) in [
            (HeadSum::TensorCore, ScaleFold::Chain128),
            (HeadSum::Ordered, ScaleFold::Chain128),
            (HeadSum::TensorCore, ScaleFold::Chain64),
            (HeadSum::Ordered, ScaleFold::Chain64),
        ] {
            let full = fold == ScaleFold::Chain128;
            let plan = |chunk_keys, stage_keys, chunks_per_block| SelectPlan {
                chunk_keys,
                stage_keys,
                head_sum,
                fold,
                chunks_per_block,
                streamed: false,
                fused_topk: None,
                topk_cluster: fast_indexer::TOPK_CLUSTER,
            };
            let own = |t| {
                let chunk_keys = fast_indexer::chunk_keys_for(t, MAXE);
                plan(
                    chunk_keys,
                    fast_indexer::stage_keys_for(MAXE, fast_indexer::TOPK_CLUSTER),
                    fast_indexer::chunks_per_block_for(t, MAXE, chunk_keys),
                )
            };
            let all = fast_indexer::stage_keys_for(MAXE, fast_indexer::TOPK_CLUSTER);
            let how = Rounding { head_sum, fold };
            let check_splits = |name: &str, keys: &Keys, b: &Batch| {
                // The splits, then the plain kernel of the same head sum (last; its own bound).
                let plain = SelectPlan {
                    fold: ScaleFold::Off,
                    chunks_per_block: 1,
                    ..own(b.t())
                };
                let mut plans: Vec<Option<SelectPlan>> = [
                    own(b.t()),
                    own(b.t()),
                    plan(64, 0, 1),
                    plan(128, 300, 3),
                    plan(192, 16, 2),
                    plan(256, all, 8),
                ]
                .into_iter()
                .map(Some)
                .collect();
                // Where the fast set's own call (`select`, fast_indexer::select_plan) is this one: the
                // same bits.
                if own(b.t()) == fast_indexer::select_plan(b.t(), MAXE) {
                    plans.push(None);
                }
                plans.push(Some(plain));
                let (r, f) = run_plans(reference, fast, keys, b, s, &plans);
                let (worst, swaps) = check(name, keys, b, &r, &f[0], how);
                let splits = plans.len() - 1;
                assert_all_but_last_alike(name, &plans, &f);
                // Beside the plain kernel: its distance and swaps against the reference, and how many
                // scores the fold changed (none would mean no tile folded: a report, not a check, as
                // the tensor core's sums may happen to agree).
                let plain_name = format!("{name} (plain kernel)");
                let (plain_worst, plain_swaps) = check(
                    &plain_name,
                    keys,
                    b,
                    &r,
                    &f[splits],
                    Rounding {
                        fold: ScaleFold::Off,
                        ..how
                    },
                );
                let changed = scores_differing(&f[0], &f[splits]);
                println!(
                    "{name}: fold / plain: max |fast - ref| / bound {worst:.3} / {plain_worst:.3}, selected entries that differ from the reference {swaps} / {plain_swaps}, scores the fold changed {changed}"
                );
            };
            fold_batches(
                &mut rng,
                &format!("{fold:?} {head_sum:?}, "),
                full,
                &check_splits,
            );
            if !full {
                continue;
            }
            // Other head dims run the plain kernels: the same bits as without the fold.
            let label = format!("{fold:?} {head_sum:?}");
            other_dims_run_the_plain_kernel(reference, fast, s, &mut rng, &label, &own);
            for patterns in [1, 3] {
                let keys = Keys::from_patterns(&mut rng, Some(patterns), DI);
                let seqs = decode(8, &[3, 700, 2047, 2048, 2049, 5000, 30_000, 65_535]);
                let b = Batch::new(&mut rng, &seqs, DI);
                let (r, f) = run_plans(reference, fast, &keys, &b, s, &[Some(own(b.t()))]);
                check(
                    &format!("{fold:?} {head_sum:?}, {patterns} key pattern(s)"),
                    &keys,
                    &b,
                    &r,
                    &f[0],
                    how,
                );
            }
        }
        // Plans the kernels cannot run: refused before any launch.
        let keys = Keys::random(&mut rng, DI);
        let b = Batch::new(&mut rng, &decode(1, &[5000]), DI);
        let base = SelectPlan {
            chunk_keys: 128,
            stage_keys: 0,
            head_sum: HeadSum::Ordered,
            fold: ScaleFold::Chain128,
            chunks_per_block: 1,
            streamed: false,
            fused_topk: None,
            topk_cluster: fast_indexer::TOPK_CLUSTER,
        };
        let bad = [
            // Chunks that are not whole tiles, with the fold.
            SelectPlan {
                chunk_keys: 100,
                ..base
            },
            // Several chunks a block, without it.
            SelectPlan {
                fold: ScaleFold::Off,
                chunks_per_block: 2,
                ..base
            },
            SelectPlan {
                chunks_per_block: 0,
                ..base
            },
            // A top-k cluster of none, or past the portable size.
            SelectPlan {
                topk_cluster: 0,
                ..base
            },
            SelectPlan {
                topk_cluster: fast_indexer::TOPK_CLUSTER + 1,
                ..base
            },
        ];
        for p in bad {
            let g = family_gpu(&FAMILIES).unwrap();
            let err = refused(&g.ctx, fast, &keys, &b, p, s);
            assert!(err.contains("out of range"), "{p:?}: {err}");
        }
    });
}

/// The portable cluster sizes the fused plans' tests run (fi_select_stream_kernel takes any up to
/// FUSED_MAX_CLUSTER: 3 gives uneven runs; the non-portable ones have a test of their own).
const FUSED_CLUSTERS: [usize; 5] = [1, 2, 3, 4, fast_indexer::TOPK_CLUSTER];

/// `fused_plan`'s plan for `t` tokens over clusters of `cluster` blocks, writing the scores row
/// (`write_scores`) or not.
fn fused(t: usize, cluster: usize, write_scores: bool) -> SelectPlan {
    let plan = fast_indexer::fused_plan(t, MAXE, cluster).expect("MAXE's runs fit the stage");
    SelectPlan {
        fused_topk: Some(FusedTopk {
            cluster,
            write_scores,
        }),
        ..plan
    }
}

/// A streamed plan with the top-k in its launch over `cluster` blocks, in range or not.
fn fused_with(cluster: usize) -> SelectPlan {
    SelectPlan {
        fused_topk: Some(FusedTopk {
            cluster,
            write_scores: true,
        }),
        ..fast_indexer::stream_plan(1, MAXE)
    }
}

/// The streamed kernel (`SelectPlan::streamed`: fi_score_stream_kernel, one page a tile through a
/// ring, the keys decoded into the wgmmas' registers): scores within the fold's bound with one chain
/// (module doc; its k32 steps group the products otherwise than the tiled fold kernel's, so not
/// that kernel's bits) and the selection the exact top-k of its own scores, at Flash's shapes, with
/// tied scores and with keys and tokens that cannot fold; every number of tiles a block (odd ones,
/// one warpgroup idle, a block per tile) gives the same bits, and reruns too; so does the top-k in
/// the scoring launch (`SelectPlan::fused_topk`: fi_select_stream_kernel) at every cluster size,
/// and without the scores row it writes none and selects the same. At other head dims the plan runs
/// the plain kernel with its head sum (its bits). Streamed plans without the fold or the
/// tensor-core head sum, and fused ones without the stream or with clusters out of range, are
/// refused (runs too long for the stage: the module's unit test).
#[test]
fn streamed_scores_match_the_reference_within_the_fold_bound() {
    with_indexers(|reference, fast, s| {
        let mut rng = XorShift(0x57ea_5eed);
        let how = Rounding {
            head_sum: HeadSum::TensorCore,
            fold: ScaleFold::Chain128,
        };
        let tiled = |t| fast_indexer::fast_plan(t, MAXE);
        let check_splits = |name: &str, keys: &Keys, b: &Batch| {
            let own = fast_indexer::stream_plan(b.t(), MAXE);
            let own_tiles = own.chunks_per_block;
            let mut plans: Vec<Option<SelectPlan>> = [own_tiles, own_tiles, 1, 2, 5, 64]
                .into_iter()
                .map(|tiles| {
                    Some(SelectPlan {
                        chunks_per_block: tiles,
                        ..own
                    })
                })
                .collect();
            // The top-k in the scoring launch, at every cluster size (uneven runs, idle blocks),
            // writing the scores row too: the same scores and selection.
            plans.extend(FUSED_CLUSTERS.map(|cluster| Some(fused(b.t(), cluster, true))));
            // Where the fast set's own call (`select`, fast_indexer::select_plan) is this one: the
            // same bits.
            if own == fast_indexer::select_plan(b.t(), MAXE) {
                plans.push(None);
            }
            plans.push(Some(tiled(b.t())));
            // Then the fused plans as the fast set would run them: the scores row is not written
            // (it keeps its poison), the selection is the same.
            let quiet = FUSED_CLUSTERS.map(|cluster| Some(fused(b.t(), cluster, false)));
            let all: Vec<_> = plans.iter().chain(&quiet).copied().collect();
            let (r, mut f) = run_plans(reference, fast, keys, b, s, &all);
            let q = f.split_off(plans.len());
            let (worst, swaps) = check(name, keys, b, &r, &f[0], how);
            let streamed = plans.len() - 1;
            assert_all_but_last_alike(name, &plans, &f);
            for (p, run) in quiet.iter().zip(&q) {
                assert!(
                    run.scores.iter().all(|v| v.to_bits() == u32::MAX),
                    "{name}: {p:?} wrote the scores row"
                );
                assert!(
                    run.selected == f[0].selected && run.nsel == f[0].nsel,
                    "{name}: {p:?} selects otherwise than {:?}",
                    plans[0]
                );
            }
            // Beside the tiled fold kernel (the fast set's): how many scores the k order changed.
            let changed = scores_differing(&f[0], &f[streamed]);
            println!(
                "{name}: streamed: max |fast - ref| / bound {worst:.3}, selected entries that differ from the reference {swaps}, scores that differ from the tiled fold kernel's {changed}"
            );
        };
        fold_batches(&mut rng, "", true, &check_splits);
        for patterns in [1, 3] {
            let keys = Keys::from_patterns(&mut rng, Some(patterns), DI);
            let seqs = decode(8, &[3, 700, 2047, 2048, 2049, 5000, 30_000, 65_535]);
            let b = Batch::new(&mut rng, &seqs, DI);
            check_splits(&format!("{patterns} key pattern(s)"), &keys, &b);
        }
        // Other head dims run the plain kernel of the plan's head sum: its bits.
        let stream_plan = |t| fast_indexer::stream_plan(t, MAXE);
        other_dims_run_the_plain_kernel(reference, fast, s, &mut rng, "streamed", &stream_plan);
        let fused_plan = |t| fused(t, 4, true);
        other_dims_run_the_plain_kernel(reference, fast, s, &mut rng, "fused", &fused_plan);
        // Streamed plans the kernel cannot run: refused before any launch.
        let keys = Keys::random(&mut rng, DI);
        let b = Batch::new(&mut rng, &decode(1, &[5000]), DI);
        let base = fast_indexer::stream_plan(1, MAXE);
        let bad = [
            SelectPlan {
                fold: ScaleFold::Off,
                chunks_per_block: 1,
                ..base
            },
            SelectPlan {
                fold: ScaleFold::Chain64,
                ..base
            },
            SelectPlan {
                head_sum: HeadSum::Ordered,
                ..base
            },
            // The top-k in the launch: not streamed, no cluster, one past the largest (runs that do
            // not fit the stage: the module's unit test).
            SelectPlan {
                streamed: false,
                ..fused(1, 2, true)
            },
            fused_with(0),
            fused_with(fast_indexer::FUSED_MAX_CLUSTER + 1),
        ];
        for p in bad {
            let g = family_gpu(&FAMILIES).unwrap();
            let err = refused(&g.ctx, fast, &keys, &b, p, s);
            assert!(err.contains("out of range"), "{p:?}: {err}");
        }
    });
}

/// The top-k in the scoring launch over clusters above the portable 8 (FUSED_MAX_CLUSTER = 16, which
/// the registry allows for fi_select_stream_kernel and H100 / H200 schedule): the streamed kernel's
/// scores and selection, bit for bit, with and without the scores row, on the Flash batches and one
/// token of a 64K context (16 runs of 1024 keys). Apart from the portable sizes' test, so that a
/// device that cannot schedule such a cluster fails here alone.
#[test]
fn fused_plans_run_in_clusters_of_16() {
    with_indexers(|reference, fast, s| {
        let mut rng = XorShift(0xc105_7e16);
        let cluster = fast_indexer::FUSED_MAX_CLUSTER;
        assert!(cluster > fast_indexer::TOPK_CLUSTER);
        let keys = Keys::random(&mut rng, DI);
        let mut batches = flash_batches().to_vec();
        batches.push(decode(1, &[65_535]));
        for (k, seqs) in batches.iter().enumerate() {
            let b = Batch::new(&mut rng, seqs, DI);
            let stream = fast_indexer::stream_plan(b.t(), MAXE);
            let plans = [
                Some(stream),
                Some(fused(b.t(), cluster, true)),
                Some(fused(b.t(), cluster, false)),
            ];
            let (_, f) = run_plans(reference, fast, &keys, &b, s, &plans);
            let name = format!("batch {k}, clusters of {cluster}");
            assert!(same_result(&f[1], &f[0]), "{name}: not the stream's result");
            assert!(
                f[2].scores.iter().all(|v| v.to_bits() == u32::MAX),
                "{name}: wrote the scores row"
            );
            assert!(
                f[2].selected == f[0].selected && f[2].nsel == f[0].nsel,
                "{name}: selects otherwise without the scores row"
            );
        }
    });
}
