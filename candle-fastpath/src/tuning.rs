//! The rule that picks a cuBLASLt algorithm from timed candidates (lever 79, `cuda.rs`'s
//! `tune_plan`), apart from the timing so that it is tested without a GPU.

/// Of `(time, candidate)` pairs, the first being the heuristic's first pick: the fastest, if it
/// beats the first pick's time by at least `margin` (a fraction, e.g. 0.03), else the first
/// pick; `None` for no pairs. A margin keeps measurement noise from swapping picks that are
/// equally fast.
pub(crate) fn fastest_or_first<A: Copy>(times: &[(f32, A)], margin: f32) -> Option<A> {
    let &(first_time, first) = times.first()?;
    let &(time, fastest) = times.iter().min_by(|a, b| a.0.total_cmp(&b.0))?;
    Some(if time < (1.0 - margin) * first_time {
        fastest
    } else {
        first
    })
}

#[cfg(test)]
mod tests {
    use super::fastest_or_first;

    #[test]
    fn keeps_the_first_pick_unless_another_is_clearly_faster() {
        assert_eq!(fastest_or_first::<u8>(&[], 0.03), None);
        assert_eq!(fastest_or_first(&[(5.0, 0)], 0.03), Some(0));
        // 2 % faster: within the margin, the first pick stays.
        assert_eq!(fastest_or_first(&[(5.0, 0), (4.9, 1)], 0.03), Some(0));
        // 10 % faster: taken, and the fastest of several, wherever it is.
        assert_eq!(
            fastest_or_first(&[(5.0, 0), (4.5, 1), (4.0, 2), (4.8, 3)], 0.03),
            Some(2)
        );
        // Slower candidates never replace it.
        assert_eq!(fastest_or_first(&[(5.0, 0), (6.0, 1)], 0.03), Some(0));
    }
}
