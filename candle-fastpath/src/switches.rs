//! Run-time switches for A/B measurements: environment variables read once per process, so the
//! hot path pays one atomic load. The defaults are the measured winners; each switch brings back
//! the code it replaced (see the README's list and `docs/LEVERS.md`).

use std::sync::OnceLock;

/// The value of `name` (trimmed; `None` when unset or not Unicode), decoded by `decode` on the
/// first call and cached in `cell` for the life of the process.
pub(crate) fn read_once<T: Copy>(
    cell: &'static OnceLock<T>,
    name: &str,
    decode: impl FnOnce(Option<&str>) -> T,
) -> T {
    *cell.get_or_init(|| decode(std::env::var(name).ok().as_deref().map(str::trim)))
}

/// A switch that is on unless `name` is `0` or `off` (read once, cached in `cell`).
pub(crate) fn on_unless_off(cell: &'static OnceLock<bool>, name: &str) -> bool {
    read_once(cell, name, |v| !matches!(v, Some("0") | Some("off")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_once_and_caches() {
        static CELL: OnceLock<u8> = OnceLock::new();
        // An unset variable reaches the decoder as None ...
        let first = read_once(&CELL, "CANDLE_FASTPATH_TEST_SWITCH_UNSET", |v| {
            if v.is_none() {
                1
            } else {
                2
            }
        });
        assert_eq!(first, 1);
        // ... and later calls return the cached value without decoding again.
        let second = read_once(&CELL, "CANDLE_FASTPATH_TEST_SWITCH_UNSET", |_| 3);
        assert_eq!(second, 1);
    }
}
