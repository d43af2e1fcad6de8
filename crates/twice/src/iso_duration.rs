//! ISO-8601 durations, as `Config.json` and the Service Bus management API write them: the
//! one parser and formatter that the broker's configuration, the administration API and the
//! Service Bus client's ATOM reader share.

use std::fmt::Write as _;
use std::time::Duration;

/// Parses an ISO-8601 duration: `P[nY][nM][nW][nD][T[nH][nM][nS]]`, e.g. `PT1M`, `P7D`,
/// `PT10M30S`, `PT0.5S`. A year counts 365 days and a month 30 days, as .NET's
/// `XmlConvert.ToTimeSpan` does. Any component may have a decimal fraction.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not an ISO-8601 duration such as PT1M, PT30S or P7D");
    let rest = s.strip_prefix('P').ok_or_else(bad)?;
    if rest.is_empty() {
        return Err(bad());
    }
    const SEC: u128 = 1_000_000_000;
    let mut total: u128 = 0;
    let mut in_time = false;
    let mut components = 0;
    // Order of the designators seen so far, so that `PT1S1M` is rejected.
    let mut last_rank = 0;
    let mut chars = rest.char_indices().peekable();
    while let Some(&(start, c)) = chars.peek() {
        if c == 'T' {
            if in_time {
                return Err(bad());
            }
            in_time = true;
            chars.next();
            if chars.peek().is_none() {
                return Err(bad());
            }
            continue;
        }
        let mut end = start;
        while let Some(&(i, c)) = chars.peek() {
            if c.is_ascii_digit() || c == '.' || c == ',' {
                end = i + c.len_utf8();
                chars.next();
            } else {
                break;
            }
        }
        let number = &rest[start..end];
        let (_, unit) = chars.next().ok_or_else(bad)?;
        if number.is_empty() {
            return Err(bad());
        }
        let (rank, unit_nanos) = match (in_time, unit) {
            (false, 'Y') => (1, 365 * 86_400 * SEC),
            (false, 'M') => (2, 30 * 86_400 * SEC),
            (false, 'W') => (3, 7 * 86_400 * SEC),
            (false, 'D') => (4, 86_400 * SEC),
            (true, 'H') => (5, 3600 * SEC),
            (true, 'M') => (6, 60 * SEC),
            (true, 'S') => (7, SEC),
            _ => return Err(bad()),
        };
        if rank <= last_rank {
            return Err(bad());
        }
        last_rank = rank;
        components += 1;
        let (int, frac) = match number.split_once(['.', ',']) {
            Some((i, f)) => (i, f),
            None => (number, ""),
        };
        if int.is_empty() || frac.contains(['.', ',']) || frac.len() > 9 {
            return Err(bad());
        }
        let int: u128 = int.parse().map_err(|_| bad())?;
        let mut nanos = int.checked_mul(unit_nanos).ok_or_else(bad)?;
        if !frac.is_empty() {
            let digits = u32::try_from(frac.len()).map_err(|_| bad())?;
            let f: u128 = frac.parse().map_err(|_| bad())?;
            // Checked: a number that fits with its whole units alone may not with its
            // fraction, and must not wrap around to a small duration.
            nanos = nanos.checked_add(f * unit_nanos / 10u128.pow(digits)).ok_or_else(bad)?;
        }
        total = total.checked_add(nanos).ok_or_else(bad)?;
    }
    if components == 0 {
        return Err(bad());
    }
    let secs = u64::try_from(total / SEC).map_err(|_| bad())?;
    let nanos = u32::try_from(total % SEC).map_err(|_| bad())?;
    Ok(Duration::new(secs, nanos))
}

/// Formats a duration in ISO-8601 (`PT1M`, `P7D`, `PT0.5S`).
pub fn format_duration(d: Duration) -> String {
    let mut out = String::from("P");
    let mut secs = d.as_secs();
    let days = secs / 86_400;
    secs %= 86_400;
    if days > 0 {
        let _ = write!(out, "{days}D");
    }
    let nanos = d.subsec_nanos();
    if secs > 0 || nanos > 0 || days == 0 {
        out.push('T');
        let (h, m, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
        if h > 0 {
            let _ = write!(out, "{h}H");
        }
        if m > 0 {
            let _ = write!(out, "{m}M");
        }
        if nanos > 0 {
            let frac = format!("{nanos:09}");
            let _ = write!(out, "{s}.{}S", frac.trim_end_matches('0'));
        } else if s > 0 || (h == 0 && m == 0) {
            let _ = write!(out, "{s}S");
        }
    }
    out
}
