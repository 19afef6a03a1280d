"""The Redis side: leases (claim, renew, release), their renewer thread, the client and the Lua
scripts."""
