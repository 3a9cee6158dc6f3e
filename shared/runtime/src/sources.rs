//! Source allow-lists: the addresses (single IPs or CIDR blocks) an endpoint takes calls from,
//! for callers that sign nothing (Mattermost's action calls carry the clicker's user id as the
//! server's word, so a caller that could reach the endpoint could vote as anyone).

use std::net::IpAddr;

/// One allowed block: an address and how many leading bits must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    addr: IpAddr,
    bits: u8,
}

impl Block {
    /// `10.0.0.5`, `10.1.0.0/16`, `fd00::/8`, `::1`.
    pub fn parse(text: &str) -> Result<Block, String> {
        let text = text.trim();
        let (addr, bits) = match text.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (text, None),
        };
        let addr: IpAddr =
            addr.parse().map_err(|_| format!("'{text}' is not an IP address or a CIDR block (10.1.0.0/16)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(b) => match b.parse::<u8>() {
                Ok(n) if n <= max => n,
                _ => return Err(format!("'{text}': the prefix length must be 0 to {max}")),
            },
        };
        Ok(Block { addr: canonical(addr), bits })
    }

    /// Whether `ip` is in this block (an IPv4 address written as IPv6, `::ffff:10.0.0.5`, is
    /// the IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - self.bits as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - self.bits as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The sources an endpoint takes calls from: the configured blocks, or, when none are
/// configured, this machine only (loopback).
#[derive(Debug, Clone)]
pub struct Sources {
    blocks: Vec<Block>,
}

impl Sources {
    /// Parse `allow_from` for an endpoint listening on `listen` (`what` names the setting in
    /// errors). With none configured, only loopback callers are taken, and a `listen` other
    /// machines can reach is refused: its callers would all be turned away.
    pub fn parse(allow_from: &[String], listen: &str, what: &str) -> Result<Sources, String> {
        let blocks =
            allow_from.iter().map(|s| Block::parse(s).map_err(|e| format!("{what}: {e}"))).collect::<Result<_, _>>()?;
        if allow_from.is_empty() && !loopback_only(listen) {
            return Err(format!(
                "{what} is empty but listen {listen} takes calls from other machines: name the addresses \
                 allowed to call (the chat server's, or the proxy's in front of the bridge; a CIDR block \
                 such as 10.1.0.0/16 is fine), or listen on 127.0.0.1"
            ));
        }
        Ok(Sources { blocks })
    }

    /// Whether a call from `ip` is taken.
    pub fn allows(&self, ip: IpAddr) -> bool {
        if self.blocks.is_empty() {
            return canonical(ip).is_loopback();
        }
        self.blocks.iter().any(|b| b.contains(ip))
    }
}

/// Whether `listen` (`host:port`) takes calls from this machine only.
fn loopback_only(listen: &str) -> bool {
    let host = listen.rsplit_once(':').map_or(listen, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn blocks_hold_what_their_prefix_says() {
        let b = Block::parse("10.1.0.0/16").unwrap();
        assert!(b.contains(ip("10.1.200.3")) && !b.contains(ip("10.2.0.1")));
        assert!(b.contains(ip("::ffff:10.1.0.9")), "an IPv4 address written as IPv6");
        let one = Block::parse("192.0.2.7").unwrap();
        assert!(one.contains(ip("192.0.2.7")) && !one.contains(ip("192.0.2.8")));
        assert!(Block::parse("0.0.0.0/0").unwrap().contains(ip("203.0.113.1")));
        let v6 = Block::parse("fd00::/8").unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")) && !v6.contains(ip("10.0.0.1")));
        for bad in ["10.1.0.0/33", "10.1.0/16", "mattermost.example.com", "::1/129", "10.0.0.1/x", ""] {
            assert!(Block::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn without_a_list_only_this_machine_calls_and_a_public_listen_needs_one() {
        let local = Sources::parse(&[], "127.0.0.1:3001", "allow_from").unwrap();
        assert!(local.allows(ip("127.0.0.1")) && local.allows(ip("::1")) && !local.allows(ip("10.0.0.5")));
        assert!(Sources::parse(&[], "[::1]:3001", "allow_from").is_ok());
        assert!(Sources::parse(&[], "localhost:3001", "allow_from").is_ok());
        for public in ["0.0.0.0:3001", "[::]:3001", "10.0.0.2:3001", "bridge.internal:3001"] {
            let e = Sources::parse(&[], public, "[bridge.mattermost] allow_from").unwrap_err();
            assert!(e.contains("takes calls from other machines"), "{public}: {e}");
        }
        let listed = Sources::parse(&["10.0.0.5".into(), "10.9.0.0/16".into()], "0.0.0.0:3001", "x").unwrap();
        assert!(listed.allows(ip("10.0.0.5")) && listed.allows(ip("10.9.3.3")));
        assert!(!listed.allows(ip("127.0.0.1")), "a list replaces loopback: a local proxy must be listed");
        let e =
            Sources::parse(&["mm.example.com".into()], "0.0.0.0:3001", "[bridge.mattermost] allow_from").unwrap_err();
        assert!(e.contains("[bridge.mattermost] allow_from: 'mm.example.com' is not an IP address"), "{e}");
    }
}
