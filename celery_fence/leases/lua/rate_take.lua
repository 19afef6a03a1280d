-- rate_take.lua: take one token from a rate limit's bucket, shared by every worker
-- (fence_rate_limit). One key, so it works on a Redis Cluster; time is the server's (TIME), so
-- workers' clocks do not matter.
-- KEYS[1]  bucket key "<prefix>:{r<digest(bucket)>}:rate", a hash {tokens, ts, promised}
-- ARGV[1]  refill rate, tokens per second
-- ARGV[2]  capacity (burst), tokens; a fresh bucket starts full
-- A refused caller is promised a later moment: ``promised`` advances one token's time per
-- refusal, so the refused are told to come back one after another (about one per token),
-- not all at the moment the next token is due.
-- Returns {1, 0} when a token was taken,
--         {0, wait_ms} when the bucket is empty (wait_ms: when to come back).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate = tonumber(ARGV[1]) / 1000  -- tokens per millisecond
local capacity = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts', 'promised')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
local promised = tonumber(state[3]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local granted, wait = 0, 0
if tokens >= 1 - 1e-9 then
  tokens = tokens - 1
  granted = 1
else
  local due = now + math.ceil((1 - tokens) / rate)
  promised = math.max(promised + 1 / rate, due)
  wait = math.ceil(promised - now)
end
if promised < now then
  promised = now
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens),
  'ts', string.format('%d', math.max(now, ts)), 'promised', string.format('%.17g', promised))
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate) + math.ceil(promised - now) + 1000)
return {granted, wait}
