//! Deterministic random numbers for tests: two generators, kept apart because each test's
//! stream of values must stay what it was.

/// xorshift64 (shifts 13, 7, 17), raw state: the generator of the CPU-side tests, the
/// attention sequences and `tokens`.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// `next() % n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in [-scale, scale).
    pub fn f(&mut self, scale: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }

    /// `n` values of `f(scale)`, rounded to BF16 when `bf16`.
    pub fn vec(&mut self, n: usize, scale: f32, bf16: bool) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let v = self.f(scale);
                if bf16 {
                    half::bf16::from_f32(v).to_f32()
                } else {
                    v
                }
            })
            .collect()
    }
}

/// `n` token ids in 0..256 from `seed` (xorshift64 of the golden-ratio-mixed seed).
pub fn tokens(seed: u64, n: usize) -> Vec<i32> {
    let mut x = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n).map(|_| (x.next() % 256) as i32).collect()
}

/// xorshift64* (shifts 12, 25, 27, then a multiply): the kernel tests' generator.
pub struct Rng(pub u64);

impl Rng {
    /// Deterministic per seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// Fresh inputs each run, reproducible from the printed seed: `DSV4_TEST_SEED`, else the
    /// clock.
    pub fn from_env(tag: &str) -> Rng {
        let seed = std::env::var("DSV4_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        println!("{tag}: seed {seed} (DSV4_TEST_SEED={seed} repeats it)");
        let mut r = Rng(seed ^ 0x9e37_79b9_7f4a_7c15);
        r.u64();
        r
    }

    pub fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1), 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, 1), 24 bits.
    pub fn unit_f32(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi) from `unit_f32`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit_f32()
    }

    /// Uniform in [lo, hi) from `unit`, rounded to f32.
    pub fn range(&mut self, lo: f64, hi: f64) -> f32 {
        (lo + (hi - lo) * self.unit()) as f32
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.unit().max(1e-300);
        let u2 = self.unit();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }

    /// A value of wildly varying magnitude (2^-20 .. 2^12), random sign: makes the f64 sums
    /// order-sensitive, so only the reference's exact order reproduces them.
    pub fn wild(&mut self) -> f32 {
        let m = 1.0 + self.unit_f32();
        let e = (self.u64() % 33) as i32 - 20;
        let s = if self.u64() & 1 == 0 { 1.0 } else { -1.0 };
        s * m * 2f32.powi(e)
    }

    /// `n` values: `wild()` or uniform in [-1, 1).
    pub fn values(&mut self, n: usize, wild: bool) -> Vec<f32> {
        (0..n)
            .map(|_| {
                if wild {
                    self.wild()
                } else {
                    self.uniform(-1.0, 1.0)
                }
            })
            .collect()
    }
}
