-- retry_budget.lua: spend one retry from a task name's shared retry budget (a token bucket).
-- Called only on the failure path, so a successful execution never pays a round trip.
-- KEYS[1]  budget key "<prefix>:budget:<task name>", a hash {tokens, calls, ts}
-- ARGV[1]  now, milliseconds (the caller's wall clock; a clock behind the stored ts adds nothing)
-- ARGV[2]  window, milliseconds
-- ARGV[3]  floor: tokens refilled per window, and the bucket's size without traffic
-- ARGV[4]  ratio: tokens deposited per call
-- ARGV[5]  calls the caller made since its last report (decayed, may be fractional)
-- The bucket: tokens grow by floor per window and ratio per call, capped at
-- floor + ratio * recent calls (calls decay with time constant = window).
-- Returns {1, 0} when a token was spent (retry now),
--         {0, wait_ms} when the bucket is empty (wait_ms until it holds a token again).
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local floor = tonumber(ARGV[3])
local ratio = tonumber(ARGV[4])
local new_calls = tonumber(ARGV[5])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'calls', 'ts')
local tokens = tonumber(state[1]) or floor
local calls = tonumber(state[2]) or 0
local ts = tonumber(state[3]) or now
local elapsed = math.max(0, now - ts)
calls = calls * math.exp(-elapsed / window) + new_calls
tokens = math.min(tokens + floor * elapsed / window + ratio * new_calls, floor + ratio * calls)
local granted, wait = 0, 0
if tokens >= 1 - 1e-9 then
  tokens = math.max(0, tokens - 1)
  granted = 1
elseif floor > 0 then
  wait = math.ceil((1 - tokens) * window / floor)
else
  wait = window
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens),
  'calls', string.format('%.17g', calls), 'ts', string.format('%d', math.max(now, ts)))
redis.call('PEXPIRE', KEYS[1], math.ceil(3 * window))
return {granted, wait}
