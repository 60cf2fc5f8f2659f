//! Java-compatible murmur2, as Kafka's `DefaultPartitioner` (and librdkafka's
//! `murmur2_random`) uses it: a keyed record lands in
//! `toPositive(murmur2(key)) % partitions`. delayd's producer is configured
//! with `murmur2_random`; this copy lets tests and tools check the placement.

/// `org.apache.kafka.common.utils.Utils.murmur2`, as an `i32` like Java's.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let length = data.len() as u32;
    let mut h: u32 = SEED ^ length;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    // Java's switch falls through from 3 to 2 to 1.
    if tail.len() >= 3 {
        h ^= (tail[2] as u32) << 16;
    }
    if tail.len() >= 2 {
        h ^= (tail[1] as u32) << 8;
    }
    if !tail.is_empty() {
        h ^= tail[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Java's default partitioner picks for a keyed record.
pub fn partition_for_key(key: &[u8], partitions: i32) -> i32 {
    debug_assert!(partitions > 0);
    (murmur2(key) & 0x7fff_ffff) % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vectors from Kafka's own `UtilsTest.testMurmur2`.
    #[test]
    fn matches_java_vectors() {
        let cases: &[(&str, i32)] = &[
            ("21", -973932308),
            ("foobar", -790332482),
            ("a-little-bit-long-string", -985981536),
            ("a-little-bit-longer-string", -1486304829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58897971,
            ),
            ("abc", 479470107),
        ];
        for (key, want) in cases {
            assert_eq!(murmur2(key.as_bytes()), *want, "murmur2({key:?})");
        }
    }

    #[test]
    fn partition_is_non_negative_and_in_range() {
        for i in 0..10_000u32 {
            let p = partition_for_key(&i.to_le_bytes(), 7);
            assert!((0..7).contains(&p));
        }
        // toPositive masks the sign bit rather than taking abs().
        assert_eq!(
            partition_for_key(b"21", 1000),
            (-973932308i32 & 0x7fffffff) % 1000
        );
    }
}
