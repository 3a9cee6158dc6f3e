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
        let written: IpAddr =
            addr.parse().map_err(|_| format!("'{text}' is not an IP address or a CIDR block (10.1.0.0/16)"))?;
        let max = if written.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(b) => match b.parse::<u8>() {
                Ok(n) if n <= max => n,
                _ => return Err(format!("'{text}': the prefix length must be 0 to {max}")),
            },
        };
        // An IPv4 address written as IPv6 (`::ffff:10.0.4.17/128`) is that IPv4 address, its
        // prefix counted in IPv4's 32 bits.
        let (addr, bits) = match canonical(written) {
            v4 @ IpAddr::V4(_) if written.is_ipv6() => match bits.checked_sub(96) {
                Some(b) => (v4, b),
                None => return Err(format!("'{text}': an IPv4 address written as IPv6 needs a prefix of 96 or more")),
            },
            addr => (addr, bits),
        };
        let block = Block { addr, bits };
        // `10.1.2.3/16` is most likely a typo: say which block it would be.
        if block.mask_of(addr) != addr {
            return Err(format!("'{text}' has bits set past its prefix: did you mean {}/{bits}?", block.mask_of(addr)));
        }
        Ok(block)
    }

    /// `ip` with the bits past this block's prefix cleared.
    fn mask_of(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => IpAddr::V4((u32::from(v4) & self.mask4()).into()),
            IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & self.mask6()).into()),
        }
    }

    fn mask4(&self) -> u32 {
        u32::MAX.checked_shl(32u32.saturating_sub(self.bits as u32)).unwrap_or(0)
    }

    fn mask6(&self) -> u128 {
        u128::MAX.checked_shl(128u32.saturating_sub(self.bits as u32)).unwrap_or(0)
    }

    /// Whether `ip` is in this block (an IPv4 address written as IPv6, `::ffff:10.0.0.5`, is
    /// the IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => u32::from(net) & self.mask4() == u32::from(ip) & self.mask4(),
            (IpAddr::V6(net), IpAddr::V6(ip)) => u128::from(net) & self.mask6() == u128::from(ip) & self.mask6(),
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
        for bad in
            ["10.1.0.0/33", "10.1.0/16", "mattermost.example.com", "::1/129", "10.0.0.1/x", "", "::ffff:10.0.0.1/64"]
        {
            assert!(Block::parse(bad).is_err(), "{bad}");
        }
        // An IPv4 address written as IPv6 is that address, and only it.
        let mapped = Block::parse("::ffff:10.0.4.17").unwrap();
        assert!(mapped.contains(ip("10.0.4.17")) && !mapped.contains(ip("10.9.9.9")));
        let mapped = Block::parse("::ffff:10.0.0.0/104").unwrap();
        assert!(mapped.contains(ip("10.200.1.1")) && !mapped.contains(ip("11.0.0.1")));
        let e = Block::parse("10.1.2.3/16").unwrap_err();
        assert!(e.contains("did you mean 10.1.0.0/16?"), "{e}");
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
