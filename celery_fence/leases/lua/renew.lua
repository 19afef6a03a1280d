-- renew.lua: extend a lease this attempt still holds; never revive an expired one.
-- KEYS[1]  lease key
-- ARGV[1]  expected value "<token>:<generation>"
-- ARGV[2]  lease TTL in milliseconds
-- Returns 1 when renewed, 0 when the lease is gone or held by someone else (lost).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
