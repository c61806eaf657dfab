"""Built-in text the tiny model's byte-level BPE tokenizer is trained on (no downloads)."""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Large language models read a prompt, split it into tokens, and predict the next token one at a time.
Each token attends to every token before it, so the keys and values of the past are kept in a cache.
A paged cache stores those keys and values in fixed blocks of sixteen tokens, like pages of memory.
When two requests share the same beginning, the blocks of that prefix are computed once and reused.
Agents send long prompts again and again: the system message, the tools, and the whole conversation.
Most of what an agent sends is input, so reusing the cached prefix saves almost all of the work.
The scheduler runs decodes first and then fills the rest of the step with chunks of waiting prompts.
If memory runs out, the newest request is preempted and recomputed later, and nobody waits forever.
Hello, world! How are you today? I am fine, thank you. What time is it? It is twelve o'clock.
Please summarize the following document in three sentences, then list the open questions.
You are a helpful assistant. Answer briefly and cite the tool results you used.
The weather today is sunny with a light breeze from the west; tomorrow it may rain in the evening.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
In the beginning there was nothing but numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048.
Dates and times: 2026-07-28, 13:40 UTC, Monday, November 30th; prices: $3.50, 12%, 1e-4, 0.02.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"{i}: {fibonacci(i)}")

class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.free = list(range(1, num_blocks))
        self.ref_counts = [0] * num_blocks

{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "generate", "arguments": {"prompt": "Hi"}}}
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC LIMIT 10;
<html><body><h1>Title</h1><p>Some paragraph text with a <a href="https://example.com">link</a>.</p></body></html>
Le renard brun saute par-dessus le chien paresseux. Ça coûte trois euros, s'il vous plaît. Où est la gare?
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Mädchen, schön, Grüße aus München.
El veloz zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca? ¡Qué día tan bonito!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо, хорошо.
敏捷的棕色狐狸跳过了懒狗。你好，世界！今天天气很好。我们一起去学习吧。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界。ありがとうございます。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요, 세계!
Emoji and symbols: 😀 🚀 ✨ 🎉 👍 ❤️ → ← ≤ ≥ ≠ ∞ ∑ π λ µ ° © ® ™ € £ ¥ • … — –
Once upon a time, in a small village by the river, there lived an old clockmaker and his daughter.
Every morning the clockmaker opened his shop, wound every clock on the wall, and listened to them tick.
The daughter wanted to see the world beyond the mountains, where the river met the distant sea.
One day a traveller came to the shop with a broken watch that no one else had been able to repair.
The clockmaker worked all night, and by sunrise the watch was running again, steady and bright.
In return the traveller told stories of cities with towers of glass and markets full of strange spices.
Science is a way of asking questions about the world and testing the answers against what we observe.
Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.
The heart pumps blood through the body; the lungs bring oxygen in and carry carbon dioxide out.
Mathematics studies numbers, shapes, patterns, and the logical relations between them.
A prime number has exactly two divisors: one and itself. Two, three, five, seven and eleven are prime.
Computers store everything as bits, zeros and ones, grouped into bytes of eight bits each.
Networks carry packets between machines; a protocol is the set of rules both sides agree to follow.
Good software is simple, tested, and honest about what it does and what it does not do.
"""
