"""Draw the small sample pictures of ``examples/images/`` (a few KB of PNG) and list them, with a question
each, in ``examples/images.jsonl``: the input of ``jobs/images.toml``. Both are in the repository already;
run this to draw them again (Pillow only, no downloads):

    python examples/make_images.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).parent
SIZE = 96

SHAPES = {  # name: (shape, colour)
    "red_circle": ("circle", (220, 30, 30)),
    "blue_square": ("square", (30, 60, 220)),
    "green_triangle": ("triangle", (30, 170, 60)),
    "yellow_star": ("star", (240, 200, 20)),
}


def draw(shape: str, colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    box = (16, 16, SIZE - 16, SIZE - 16)
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    elif shape == "square":
        pen.rectangle(box, fill=colour)
    elif shape == "triangle":
        pen.polygon([(SIZE // 2, 14), (SIZE - 14, SIZE - 18), (14, SIZE - 18)], fill=colour)
    else:
        c, r, q = SIZE / 2, SIZE / 2 - 12, SIZE / 5
        points = []
        for k in range(10):  # five points, five notches
            radius = r if k % 2 == 0 else q
            angle = math.pi * (k / 5 - 0.5)
            points.append((c + radius * math.cos(angle), c + radius * math.sin(angle)))
        pen.polygon(points, fill=colour)
    return image


def main() -> None:
    folder = HERE / "images"
    folder.mkdir(exist_ok=True)
    for name, (shape, colour) in SHAPES.items():
        draw(shape, colour).save(folder / f"{name}.png", optimize=True)
    rows = [
        {"id": "q1", "image": "images/red_circle.png", "question": "What shape is in this picture?"},
        {"id": "q2", "image": "images/blue_square.png", "question": "What colour is the shape?"},
        {
            "id": "q3",
            "image": "images/green_triangle.png",
            "question": "Describe the picture in one sentence.",
        },
        {"id": "q4", "image": "images/yellow_star.png", "question": "How many points does the star have?"},
        {
            "id": "q5",
            "image": ["images/red_circle.png", "images/blue_square.png"],
            "question": "Which of the two pictures shows a square?",
        },
        {"id": "q6", "image": None, "question": "Name three shapes with straight sides."},  # text only
    ]
    with open(HERE / "images.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
