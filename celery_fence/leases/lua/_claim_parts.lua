-- _claim_parts.lua: what claim.lua and claim_in_group.lua both do, written once; each script
-- includes it (scripts.py puts its text in place of the script's include line).
-- Both scripts: KEYS[1] the key's lease, KEYS[2] its generation counter, ARGV[1] the owner
-- token, ARGV[2] the lease TTL (ms), ARGV[3] the counter's lifetime (ms, 0: forever).

-- Release this process's finished attempts first: KEYS[3..] each with its expected value
-- ARGV[i + offset], compare-and-delete ("<token>:" matches that attempt's lease whatever its
-- generation: the release of a claim whose reply was lost).
local function release_finished(offset)
  for i = 3, #KEYS do
    local value = redis.call('GET', KEYS[i])
    local expected = ARGV[i + offset]
    if value and (value == expected
        or (string.sub(expected, -1) == ':' and string.sub(value, 1, #expected) == expected)) then
      redis.call('DEL', KEYS[i])
    end
  end
end

-- The key's next generation, and its lease "<token>:<generation>" for ARGV[2] ms.
local function take_generation()
  local generation = redis.call('INCR', KEYS[2])
  if tonumber(ARGV[3]) > 0 then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  redis.call('SET', KEYS[1], ARGV[1] .. ':' .. generation, 'PX', ARGV[2])
  return generation
end
