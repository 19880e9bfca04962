"""Seeded synthetic scenes and their questions, for the tiny vision model that mmserve
ships as its default (issue 30). A scene is one to four shapes (circle, square,
triangle, star, cross, ring) in eight colours, sizes and positions, on a plain or
textured background, with a small rotation and noise; each scene comes with questions
whose answers the scene decides:

    "Describe the image."            -> "Two red circles and a blue square."
    "How many triangles are there?"  -> "Three." / "None."
    "What colour is the star?"       -> "Yellow."   (asked only of a shape seen once)
    "Is there a circle on the left?" -> "Yes." / "No."
    two images: "Which image has more shapes?" -> "The first." / "The second." / "Neither."

Everything is a function of the seed: `scene(seed)` draws the same image and the same
questions on every machine.
"""

import io
import math
import random

from PIL import Image, ImageDraw, ImageFilter

SHAPES = ["circle", "square", "triangle", "star", "cross", "ring"]
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "orange": (245, 140, 30),
    "purple": (140, 60, 180),
    "black": (20, 20, 20),
    "brown": (130, 80, 40),
}
BACKGROUNDS = [(255, 255, 255), (235, 235, 235), (245, 240, 225), (225, 232, 240)]
NUMBERS = ["None", "One", "Two", "Three", "Four"]
PLURAL = {s: s + "s" for s in SHAPES} | {"cross": "crosses"}
SIDE = 112
# Seeds from here on are held out: training draws below HELD_OUT // 2.
HELD_OUT = 10**9


def _polygon(cx, cy, r, n, rot, inner=None):
    pts = []
    for k in range(n * (2 if inner else 1)):
        a = rot + math.pi * 2 * k / (n * (2 if inner else 1)) - math.pi / 2
        rr = r if not inner or k % 2 == 0 else r * inner
        pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return pts


def _draw(d, shape, cx, cy, r, rgb, rot, bg):
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=rgb)
    elif shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=rgb)
        d.ellipse([cx - r * 0.55, cy - r * 0.55, cx + r * 0.55, cy + r * 0.55], fill=bg)
    elif shape == "square":
        d.polygon(_polygon(cx, cy, r * 1.15, 4, rot + math.pi / 4), fill=rgb)
    elif shape == "triangle":
        d.polygon(_polygon(cx, cy, r * 1.15, 3, rot), fill=rgb)
    elif shape == "star":
        d.polygon(_polygon(cx, cy, r * 1.2, 5, rot, inner=0.45), fill=rgb)
    elif shape == "cross":
        w = r * 0.38
        for ang in (rot, rot + math.pi / 2):
            c, s = math.cos(ang), math.sin(ang)
            pts = [(-r, -w), (r, -w), (r, w), (-r, w)]
            d.polygon([(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts], fill=rgb)


def _words(shapes):
    """`[(shape, colour)]` as "two red circles and a blue square"."""
    groups = {}
    for s, c in shapes:
        groups[(c, s)] = groups.get((c, s), 0) + 1
    parts = []
    for (c, s), n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0])):
        article = "an" if c[0] in "aeiou" else "a"
        parts.append(f"{article} {c} {s}" if n == 1 else f"{NUMBERS[n].lower()} {c} {PLURAL[s]}")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def scene(seed):
    """(PIL image, shapes as [(shape, colour, x)]) of scene `seed`."""
    img, placed = layout(seed)
    return img, _named(placed)


def _named(placed):
    """A layout's shapes as the questions read them: [(shape, colour, x)]."""
    return [(shape, colour, cx) for shape, colour, cx, _, _ in placed]


def layout(seed):
    """(PIL image, shapes as [(shape, colour, x, y, radius)]) of scene `seed`."""
    rng = random.Random(seed)
    bg = rng.choice(BACKGROUNDS)
    img = Image.new("RGB", (SIDE, SIDE), bg)
    d = ImageDraw.Draw(img)
    if rng.random() < 0.3:  # a faint texture
        for _ in range(40):
            x, y = rng.randrange(SIDE), rng.randrange(SIDE)
            shade = tuple(max(0, v - rng.randrange(6, 16)) for v in bg)
            d.line([(x, y), (x + rng.randrange(-20, 20), y + rng.randrange(-20, 20))], fill=shade, width=1)
    shapes = []
    for _ in range(rng.randint(1, 4)):
        for _try in range(50):
            r = rng.uniform(9, 16)
            cx, cy = rng.uniform(r + 2, SIDE - r - 2), rng.uniform(r + 2, SIDE - r - 2)
            if all(math.hypot(cx - x, cy - y) > r + rr + 3 for _, _, x, y, rr in shapes):
                break
        else:
            continue
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        _draw(d, shape, cx, cy, r, COLOURS[colour], rng.uniform(-0.25, 0.25), bg)
        shapes.append((shape, colour, cx, cy, r))
    if rng.random() < 0.5:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.2, 0.6)))
    return img, shapes


def encode(img, seed):
    """The scene as the bytes of a PNG or a JPEG (by seed)."""
    buf = io.BytesIO()
    if random.Random(seed * 7 + 1).random() < 0.5:
        img.save(buf, "PNG")
    else:
        img.save(buf, "JPEG", quality=random.Random(seed).randint(80, 95))
    return buf.getvalue()


def questions(shapes, rng):
    """[(kind, question, answer)] about one scene."""
    pairs = [(s, c) for s, c, _ in shapes]
    out = [("describe", "Describe the image.", _words(pairs)[0].upper() + _words(pairs)[1:] + ".")]
    # Shapes that are there more often than not, so that "None." is not most answers.
    s = rng.choice([x for x, _ in pairs]) if rng.random() < 0.7 else rng.choice(SHAPES)
    n = sum(1 for x, _ in pairs if x == s)
    out.append(("count", f"How many {PLURAL[s]} are there?", NUMBERS[n] + "."))
    once = [x for x in SHAPES if sum(1 for y, _ in pairs if y == x) == 1]
    if once:
        s = rng.choice(once)
        c = next(c for x, c in pairs if x == s)
        out.append(("colour", f"What colour is the {s}?", c.capitalize() + "."))
    s = rng.choice([x for x, _ in pairs]) if rng.random() < 0.6 else rng.choice(SHAPES)
    side = rng.choice(["left", "right"])
    yes = any(x == s and ((cx < SIDE / 2) == (side == "left")) for x, _, cx in shapes)
    out.append(("position", f"Is there a {s} on the {side}?", "Yes." if yes else "No."))
    return out


def compare(a, b):
    """The two-image question about scenes with shapes `a` and `b`."""
    ans = "The first." if len(a) > len(b) else "The second." if len(b) > len(a) else "Neither."
    return ("compare", "Which image has more shapes?", ans)


# The second scene of a two-image question is scene `seed + PAIR`: far from every seed a
# training run or an evaluation draws.
PAIR = 5 * 10**8


def item(seed, rng):
    """One question about scene `seed` (about 12% of them about it and scene `seed + PAIR`):
    ([(image, its seed, its layout)], question, answer, kind), the question drawn with `rng`.
    Training, the training script's evaluation and the evaluation through a server all draw
    this way."""
    if rng.random() < 0.12:
        (a, la), (b, lb) = layout(seed), layout(seed + PAIR)
        kind, q, ans = compare(la, lb)
        return [(a, seed, la), (b, seed + PAIR, lb)], q, ans, kind
    img, placed = layout(seed)
    kind, q, ans = rng.choice(questions(_named(placed), rng))
    return [(img, seed, placed)], q, ans, kind


if __name__ == "__main__":
    for seed in range(3):
        img, shapes = scene(seed)
        for kind, q, a in questions(shapes, random.Random(seed)):
            print(seed, kind, q, "->", a)
