-- release.lua: compare-and-delete; never removes a newer attempt's lease.
-- KEYS[1]  lease key
-- ARGV[1]  expected value "<token>:<generation>", or "<token>:" for that attempt's lease
--          whatever its generation (a claim whose reply was lost; tokens are unique per attempt)
-- Returns 1 when deleted, 0 when the lease was not ours (expired or taken over).
local value = redis.call('GET', KEYS[1])
local expected = ARGV[1]
if value and (value == expected
    or (string.sub(expected, -1) == ':' and string.sub(value, 1, #expected) == expected)) then
  return redis.call('DEL', KEYS[1])
end
return 0
