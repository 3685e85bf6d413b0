//! Where a rule's counter key comes from: headers, the client address, query parameters, JWT
//! claims, constants, the endpoint, and the entries of an Envoy rate limit descriptor.
//!
//! Extraction appends into a caller-owned buffer so a request with a warm buffer allocates only
//! for the rare sources that need decoding (percent-encoded query values, JWT payloads).

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};

use base64::Engine;
use http::request::Parts;
use tollgate_crd::compiled::KeySource;

/// Separates key parts so that `("ab","c")` and `("a","bc")` never share a bucket.
pub const PART_SEPARATOR: u8 = 0x1f;
/// Largest JWT (in bytes) whose payload is decoded; larger tokens count as missing.
const MAX_JWT_BYTES: usize = 8 * 1024;

/// One Envoy rate limit descriptor, as the rate limit service presents it to the decision core:
/// in the extensions of an otherwise empty request, so the core's request facts stay one type.
/// Rules with descriptor conditions or key parts match only requests that carry one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<(String, String)>,
    /// Envoy's `hits_addend`: how many requests this one stands for (0 means 1). It
    /// multiplies the rule's cost.
    pub hits: u64,
}

impl Descriptor {
    /// The value of the first entry with `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The client address a rule or bypass list sees: the TCP peer, or the entry `trusted_hops`
/// places from the right of `X-Forwarded-For`.
///
/// Each trusted proxy appends the address it received the connection from, so the Nth entry from
/// the right was written by the outermost trusted proxy. Entries further left were sent by the
/// client and can say anything; they are never used. With fewer entries than `trusted_hops` the
/// request did not pass through the expected proxies and the peer address is used.
pub fn client_ip<'a>(parts: &'a Parts, peer: &SocketAddr, trusted_hops: u32) -> ClientAddr<'a> {
    client_ip_in(&parts.headers, peer, trusted_hops)
}

/// [`client_ip`] from the request headers alone.
pub fn client_ip_in<'a>(
    headers: &'a http::HeaderMap,
    peer: &SocketAddr,
    trusted_hops: u32,
) -> ClientAddr<'a> {
    if trusted_hops == 0 {
        return ClientAddr::Peer(peer.ip());
    }
    let mut remaining = trusted_hops as usize;
    // Later header lines were appended later, so walk lines and entries from the right.
    for line in headers.get_all("x-forwarded-for").iter().rev() {
        let Ok(text) = line.to_str() else {
            return ClientAddr::Peer(peer.ip());
        };
        for entry in text.rsplit(',') {
            remaining -= 1;
            if remaining == 0 {
                let entry = entry.trim();
                return match parse_forwarded_ip(entry) {
                    Some(ip) => ClientAddr::Forwarded(ip),
                    None => ClientAddr::Unparsed(entry),
                };
            }
        }
    }
    ClientAddr::Peer(peer.ip())
}

/// Seeds a rejected client's `Retry-After` jitter: the client's address (as `trusted_hops`
/// sees it) mixed with the counter key's hash. Seeding by the key alone sent every client of a
/// shared bucket (no key, or a key per endpoint) back in the same second; with the address, many
/// clients of one bucket spread over the jitter range, while each client's value stays stable.
pub fn client_seed(parts: &Parts, peer: &SocketAddr, trusted_hops: u32, fingerprint: u64) -> u64 {
    use std::hash::{Hash, Hasher};
    // Fixed keys for the address part; the counter key's hash is keyed by the installation's
    // secret, so one client's jitter is the same against every sidecar of the installation.
    let mut h = siphasher::sip::SipHasher13::new_with_keys(0x746f_6c6c, 0x6761_7465);
    match client_ip(parts, peer, trusted_hops) {
        ClientAddr::Peer(ip) | ClientAddr::Forwarded(ip) => ip.hash(&mut h),
        ClientAddr::Unparsed(text) => text.hash(&mut h),
    }
    fingerprint.hash(&mut h);
    h.finish()
}

/// A client address as found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAddr<'a> {
    Peer(IpAddr),
    Forwarded(IpAddr),
    /// A trusted proxy wrote something that is not an address; it still identifies the client.
    Unparsed(&'a str),
}

impl ClientAddr<'_> {
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            ClientAddr::Peer(ip) | ClientAddr::Forwarded(ip) => Some(*ip),
            ClientAddr::Unparsed(_) => None,
        }
    }
}

/// Accepts `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1` and `[2001:db8::1]:443`.
fn parse_forwarded_ip(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Some(sa.ip());
    }
    let inner = s.strip_prefix('[')?.split(']').next()?;
    inner.parse().ok()
}

/// One extracted key part.
pub enum PartValue<'a> {
    Bytes(Cow<'a, [u8]>),
    Ip(IpAddr),
    Missing,
}

/// Extracts one key part from a request.
pub fn extract<'a>(source: &'a KeySource, parts: &'a Parts, peer: &SocketAddr) -> PartValue<'a> {
    match source {
        KeySource::Header(name) => match parts.headers.get(name.as_str()) {
            Some(v) => PartValue::Bytes(Cow::Borrowed(v.as_bytes())),
            None => PartValue::Missing,
        },
        KeySource::ClientIp { trusted_hops } => match client_ip(parts, peer, *trusted_hops) {
            ClientAddr::Peer(ip) | ClientAddr::Forwarded(ip) => PartValue::Ip(ip),
            ClientAddr::Unparsed(s) => PartValue::Bytes(Cow::Borrowed(s.as_bytes())),
        },
        KeySource::QueryParam(name) => match query_param(parts.uri.query(), name) {
            Some(v) => PartValue::Bytes(v),
            None => PartValue::Missing,
        },
        KeySource::JwtClaim { header, claim } => match parts.headers.get(header.as_str()) {
            Some(v) => match jwt_claim(v.as_bytes(), claim) {
                Some(s) => PartValue::Bytes(Cow::Owned(s.into_bytes())),
                None => PartValue::Missing,
            },
            None => PartValue::Missing,
        },
        KeySource::Constant(c) => PartValue::Bytes(Cow::Borrowed(c.as_bytes())),
        KeySource::Endpoint => PartValue::Bytes(Cow::Owned(
            format!("{} {}", parts.method, parts.uri.path()).into_bytes(),
        )),
        KeySource::Descriptor(key) => match parts
            .extensions
            .get::<Descriptor>()
            .and_then(|d| d.get(key))
        {
            Some(v) => PartValue::Bytes(Cow::Borrowed(v.as_bytes())),
            None => PartValue::Missing,
        },
    }
}

impl PartValue<'_> {
    /// Appends the part to a key buffer.
    pub fn append_to(&self, buf: &mut Vec<u8>) {
        match self {
            PartValue::Bytes(b) => buf.extend_from_slice(b),
            PartValue::Ip(IpAddr::V4(v4)) => buf.extend_from_slice(&v4.octets()),
            PartValue::Ip(IpAddr::V6(v6)) => buf.extend_from_slice(&v6.octets()),
            PartValue::Missing => {}
        }
        buf.push(PART_SEPARATOR);
    }

    /// Whether the part equals one of the bypass keys (compared as text).
    pub fn is_bypass_key(&self, keys: &[String]) -> bool {
        if keys.is_empty() {
            return false;
        }
        match self {
            PartValue::Bytes(b) => keys.iter().any(|k| k.as_bytes() == b.as_ref()),
            PartValue::Ip(ip) => {
                let text = ip.to_string();
                keys.contains(&text)
            }
            PartValue::Missing => false,
        }
    }
}

/// The first value of query parameter `name`, percent-decoded only when it needs to be.
pub fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<Cow<'a, [u8]>> {
    let query = query?;
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let key_matches = if k.contains(['%', '+']) {
            form_urlencoded::parse(pair.as_bytes())
                .next()
                .is_some_and(|(dk, _)| dk == name)
        } else {
            k == name
        };
        if key_matches {
            if v.contains(['%', '+']) {
                let decoded = form_urlencoded::parse(pair.as_bytes())
                    .next()
                    .map(|(_, dv)| dv.into_owned().into_bytes())
                    .unwrap_or_default();
                return Some(Cow::Owned(decoded));
            }
            return Some(Cow::Borrowed(v.as_bytes()));
        }
    }
    None
}

/// Reads a claim from a JWT's payload **without verifying the signature**: the app behind the
/// sidecar verifies tokens; for rate limiting a forged token only selects which bucket is spent.
/// Returns `None` for anything that is not a well-formed token with that claim.
pub fn jwt_claim(header_value: &[u8], claim: &[String]) -> Option<String> {
    if header_value.len() > MAX_JWT_BYTES {
        return None;
    }
    let text = std::str::from_utf8(header_value).ok()?.trim();
    let token = match text.get(..7) {
        Some(p) if p.eq_ignore_ascii_case("bearer ") => text[7..].trim_start(),
        _ => text,
    };
    let mut segments = token.split('.');
    let (_header, payload, _sig) = (segments.next()?, segments.next()?, segments.next()?);
    if segments.next().is_some() {
        return None;
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let mut cur = &value;
    for name in claim {
        cur = cur.as_object()?.get(name)?;
    }
    match cur {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        serde_json::Value::Null => None,
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn peer() -> SocketAddr {
        "192.0.2.9:5555".parse().unwrap()
    }

    #[test]
    fn client_ip_uses_peer_without_trusted_hops() {
        let p = parts("/", &[("x-forwarded-for", "6.6.6.6")]);
        assert_eq!(
            client_ip(&p, &peer(), 0),
            ClientAddr::Peer("192.0.2.9".parse().unwrap())
        );
    }

    #[test]
    fn client_ip_counts_from_the_right_across_lines() {
        // The client spoofed 6.6.6.6; the LB appended the real address; an inner proxy appended the LB.
        let p = parts(
            "/",
            &[
                ("x-forwarded-for", "6.6.6.6, 203.0.113.7"),
                ("x-forwarded-for", "10.0.0.2"),
            ],
        );
        let ip = |n| client_ip(&p, &peer(), n).ip().unwrap().to_string();
        assert_eq!(ip(1), "10.0.0.2");
        assert_eq!(ip(2), "203.0.113.7");
        assert_eq!(ip(3), "6.6.6.6");
        assert_eq!(ip(4), "192.0.2.9", "too few entries: fall back to the peer");
    }

    #[test]
    fn forwarded_entries_with_ports_and_brackets() {
        assert_eq!(
            parse_forwarded_ip("1.2.3.4:80"),
            Some("1.2.3.4".parse().unwrap())
        );
        assert_eq!(
            parse_forwarded_ip("[2001:db8::1]:443"),
            Some("2001:db8::1".parse().unwrap())
        );
        assert_eq!(
            parse_forwarded_ip("2001:db8::1"),
            Some("2001:db8::1".parse().unwrap())
        );
        assert_eq!(parse_forwarded_ip("unknown"), None);
    }

    #[test]
    fn query_params_decode_only_when_needed() {
        assert_eq!(
            query_param(Some("a=1&key=abc"), "key").as_deref(),
            Some(&b"abc"[..])
        );
        assert!(matches!(
            query_param(Some("key=abc"), "key"),
            Some(Cow::Borrowed(_))
        ));
        assert_eq!(
            query_param(Some("key=a%20b+c"), "key").as_deref(),
            Some(&b"a b c"[..])
        );
        assert_eq!(
            query_param(Some("k%65y=v"), "key").as_deref(),
            Some(&b"v"[..])
        );
        assert_eq!(query_param(Some("key"), "key").as_deref(), Some(&b""[..]));
        assert_eq!(query_param(Some("other=1"), "key"), None);
        assert_eq!(query_param(None, "key"), None);
    }

    fn token(payload: &str) -> String {
        let e = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "Bearer {}.{}.sig",
            e.encode(r#"{"alg":"none"}"#),
            e.encode(payload)
        )
    }

    #[test]
    fn jwt_claims_are_read_without_verification() {
        let claim = |t: &str, c: &str| {
            jwt_claim(
                t.as_bytes(),
                &c.split('.').map(String::from).collect::<Vec<_>>(),
            )
        };
        let t = token(r#"{"sub":"u1","tenant":42,"org":{"id":"acme"}}"#);
        assert_eq!(claim(&t, "sub").as_deref(), Some("u1"));
        assert_eq!(claim(&t, "tenant").as_deref(), Some("42"));
        assert_eq!(claim(&t, "org.id").as_deref(), Some("acme"));
        assert_eq!(claim(&t, "org.missing"), None);
        assert_eq!(claim("Bearer not-a-jwt", "sub"), None);
        assert_eq!(claim("Bearer a.!!!.c", "sub"), None);
        assert_eq!(claim(&token("[1,2]"), "sub"), None);
        assert_eq!(claim(&"x".repeat(MAX_JWT_BYTES + 1), "sub"), None);
    }

    #[test]
    fn parts_are_separated() {
        let mut a = Vec::new();
        PartValue::Bytes(Cow::Borrowed(b"ab")).append_to(&mut a);
        PartValue::Bytes(Cow::Borrowed(b"c")).append_to(&mut a);
        let mut b = Vec::new();
        PartValue::Bytes(Cow::Borrowed(b"a")).append_to(&mut b);
        PartValue::Bytes(Cow::Borrowed(b"bc")).append_to(&mut b);
        assert_ne!(a, b);
    }
}
