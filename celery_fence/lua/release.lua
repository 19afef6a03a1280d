-- release.lua: compare-and-delete; never removes a newer attempt's lease.
-- KEYS[1]  lease key
-- ARGV[1]  expected value "<token>:<generation>"
-- Returns 1 when deleted, 0 when the lease was not ours (expired or taken over).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
