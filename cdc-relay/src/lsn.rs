//! Log sequence numbers.
//!
//! An LSN is a byte position in the write-ahead log. PostgreSQL prints it as two
//! upper-case hex halves, `XXXXXXXX/XXXXXXXX` (high and low 32 bits), e.g. `0/16B3748`.
//! Source: PostgreSQL docs, "pg_lsn Type" (§8.20).

use std::fmt;
use std::str::FromStr;

/// A WAL position in bytes since the start of the WAL stream.
///
/// Ordering follows the WAL: a larger LSN is later. `Lsn::ZERO` (`0/0`) means
/// "no position"; as a `START_REPLICATION` argument it means "resume at the
/// slot's `confirmed_flush_lsn`".
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(u64);

impl Lsn {
    /// `0/0`: no position.
    pub const ZERO: Lsn = Lsn(0);

    /// The LSN at byte position `pos` of the WAL.
    pub const fn new(pos: u64) -> Lsn {
        Lsn(pos)
    }

    /// The byte position in the WAL.
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// The position as a Prometheus gauge value (bytes; saturates at
    /// `i64::MAX`, 8 EiB of WAL).
    pub fn gauge(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }

    /// Bytes of WAL from `earlier` to `self`, zero when `earlier` is later.
    pub fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The text was not an LSN of the form `X/X` (two hex numbers of at most 8 digits).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {0:?}: expected two hex numbers separated by '/', e.g. 0/16B3748")]
pub struct ParseLsnError(pub String);

impl serde::Serialize for Lsn {
    /// As PostgreSQL prints it: `0/16B3748`.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.to_owned());
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let half = |h: &str| {
            if h.is_empty() || h.len() > 8 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            u32::from_str_radix(h, 16).map_err(|_| err())
        };
        Ok(Lsn((u64::from(half(hi)?) << 32) | u64::from(half(lo)?)))
    }
}

impl From<pgwire_replication::Lsn> for Lsn {
    fn from(l: pgwire_replication::Lsn) -> Self {
        Lsn(l.as_u64())
    }
}

impl From<Lsn> for pgwire_replication::Lsn {
    fn from(l: Lsn) -> Self {
        pgwire_replication::Lsn::from_u64(l.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_matches_postgres() {
        assert_eq!(Lsn(0x16B3748).to_string(), "0/16B3748");
        assert_eq!(Lsn((0xA << 32) | 0xFF).to_string(), "A/FF");
        assert_eq!(Lsn::ZERO.to_string(), "0/0");
    }

    #[test]
    fn parse_round_trips_and_rejects_garbage() {
        for v in [0u64, 1, 0x16B3748, u64::MAX, 0xFFFF_FFFF, 1 << 32] {
            assert_eq!(Lsn(v).to_string().parse::<Lsn>(), Ok(Lsn(v)));
        }
        for bad in [
            "",
            "0",
            "/",
            "0/",
            "/0",
            "G/0",
            "0/123456789",
            "-1/0",
            "0/0/0",
        ] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} should not parse");
        }
        assert_eq!("16/b3748".parse::<Lsn>(), Ok(Lsn((0x16 << 32) | 0xB3748)));
    }
}
