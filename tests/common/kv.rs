//! The attention tests' shared pieces of state and batch layout: block tables that are not the
//! identity, and the batch arrays of a list of sequences.

/// A permutation of the pages `0 .. n` (each page i goes to `i * m mod n`, m the first of 7919,
/// 7921, ... coprime to n): a block table under which no slot owns the pages it would own
/// statically.
pub fn scrambled_table(n: usize) -> Vec<i32> {
    let m = (0..)
        .map(|k| 7919 + 2 * k)
        .find(|m| gcd(*m, n.max(1)) == 1)
        .unwrap();
    (0..n).map(|i| (i * m % n) as i32).collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// A batch's arrays as the host passes them (and seq_of as the batch check derives it) for
/// sequences given as (slot or -1 for padding, first position, length).
pub struct BatchLayout {
    pub positions: Vec<i32>,
    pub query_start: Vec<i32>,
    pub seq_slots: Vec<i32>,
    pub seq_of: Vec<i32>,
}

impl BatchLayout {
    pub fn new(seqs: &[(i32, usize, usize)]) -> BatchLayout {
        let mut b = BatchLayout {
            positions: vec![],
            query_start: vec![0],
            seq_slots: vec![],
            seq_of: vec![],
        };
        for (i, &(slot, first, len)) in seqs.iter().enumerate() {
            b.positions.extend((first..first + len).map(|p| p as i32));
            b.query_start.push(b.positions.len() as i32);
            b.seq_slots.push(slot);
            b.seq_of.extend(std::iter::repeat_n(i as i32, len));
        }
        b
    }

    pub fn tokens(&self) -> usize {
        self.positions.len()
    }
}
