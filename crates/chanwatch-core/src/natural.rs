//! Natural order of names: runs of digits compare as numbers (`orders-2` < `orders-10`).
//! `ctl`, the status page and the admin API's channel pages sort by it.
//!
//! Owns: the order. Must not: allocate or know what the names are.

use std::cmp::Ordering;

/// Natural order: runs of digits compare as numbers, so `orders-2` < `orders-10`; equal
/// numbers with different leading zeros, and otherwise equal names, fall back to byte order.
pub fn natural(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (a.as_bytes(), b.as_bytes());
    loop {
        match (x.first(), y.first()) {
            (None, None) => return a.cmp(b),
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(c), Some(d)) if c.is_ascii_digit() && d.is_ascii_digit() => {
                let (n, rest_x) = split_digits(x);
                let (m, rest_y) = split_digits(y);
                let (n, m) = (trim_zeros(n), trim_zeros(m));
                let by_number = n.len().cmp(&m.len()).then_with(|| n.cmp(m));
                if by_number != Ordering::Equal {
                    return by_number;
                }
                (x, y) = (rest_x, rest_y);
            }
            (Some(c), Some(d)) => {
                if c != d {
                    return c.cmp(d);
                }
                (x, y) = (&x[1..], &y[1..]);
            }
        }
    }
}

fn split_digits(s: &[u8]) -> (&[u8], &[u8]) {
    let end = s
        .iter()
        .position(|c| !c.is_ascii_digit())
        .unwrap_or(s.len());
    s.split_at(end)
}

fn trim_zeros(s: &[u8]) -> &[u8] {
    let start = s.iter().position(|&c| c != b'0').unwrap_or(s.len());
    &s[start..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_inside_names_sort_as_numbers() {
        let mut names = vec![
            "orders-10",
            "orders-2",
            "orders-1",
            "b",
            "orders-02",
            "a-100x",
            "a-20x",
        ];
        names.sort_by(|a, b| natural(a, b));
        assert_eq!(
            names,
            [
                "a-20x",
                "a-100x",
                "b",
                "orders-1",
                "orders-02",
                "orders-2",
                "orders-10"
            ]
        );
        assert_eq!(natural("x", "x"), Ordering::Equal);
    }
}
