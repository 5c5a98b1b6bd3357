"""Deterministic general-ability multiple-choice items (a "did the merge forget?" check).

Merging fine-tuned experts can quietly damage what the base model already
knew. This module generates a small, easy, common-knowledge test set -- capitals,
opposites, animal sounds and classes, colours of everyday things, tools,
everyday science, plurals, simple counts, languages, jobs and body parts -- on
which a tiny base model (SmolLM2-135M-Instruct) scores well above chance. The
gap between the base model's score and a merged model's score on the same items
then measures how much general ability the merge lost.

Every item is a dict ``{"question": str, "choices": [str, ...], "answer": int}``
with four choices, like :mod:`mergeval.models.zoo.domains`. The facts are small
hand-written tables; each table's answers are the distractor pool for its own
questions, so the wrong choices are plausible (a capital is offered against
other capitals). Distractors are chosen so that no choice is a prefix of
another ("2" / "24"): the log-likelihood scorer sums the tokens of
``" " + choice``, so a prefix of the right answer would always score higher.

Categories were chosen by measuring the base model (prompt
``"Question: {q}\nAnswer:"``, summed log-likelihood of each choice): it gets
about 80% of ``general_items(0, 200)`` overall. Categories it answered at chance
(which day or month comes next, counts spelled as words) were left out, since
they cannot show a loss; answers that were bare, very frequent words ("fish",
"moo") carry an article so that word frequency does not decide the pick.

``general_items(seed, n)`` draws ``n`` distinct questions, balanced across
categories, and is deterministic in ``seed``.
"""

from __future__ import annotations

import random

Item = dict
Table = tuple[list[tuple[str, str]], list[str]]  # (question, answer) rows, extra distractors

N_CHOICES = 4

_COUNTRIES_CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Russia", "Moscow"),
    ("the United Kingdom", "London"),
    ("Egypt", "Cairo"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Austria", "Vienna"),
    ("Poland", "Warsaw"),
    ("Hungary", "Budapest"),
    ("the Czech Republic", "Prague"),
    ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"),
    ("Canada", "Ottawa"),
    ("Argentina", "Buenos Aires"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Thailand", "Bangkok"),
    ("South Korea", "Seoul"),
    ("India", "New Delhi"),
    ("Cuba", "Havana"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"),
    ("Vietnam", "Hanoi"),
    ("Australia", "Canberra"),
    ("Mexico", "Mexico City"),
    ("Scotland", "Edinburgh"),
    ("Wales", "Cardiff"),
    ("Colombia", "Bogota"),
    ("Venezuela", "Caracas"),
    ("Morocco", "Rabat"),
    ("Saudi Arabia", "Riyadh"),
    ("Pakistan", "Islamabad"),
    ("Afghanistan", "Kabul"),
    ("Nepal", "Kathmandu"),
    ("Malaysia", "Kuala Lumpur"),
    ("Iceland", "Reykjavik"),
    ("Romania", "Bucharest"),
    ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"),
    ("Ethiopia", "Addis Ababa"),
    ("Ghana", "Accra"),
    ("Jamaica", "Kingston"),
    ("New Zealand", "Wellington"),
    ("Chile", "Santiago"),
    ("Syria", "Damascus"),
    ("Lebanon", "Beirut"),
    ("Qatar", "Doha"),
]

_OPPOSITES = [
    ("hot", "cold"),
    ("big", "small"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("light", "dark"),
    ("open", "closed"),
    ("wet", "dry"),
    ("hard", "soft"),
    ("full", "empty"),
    ("old", "young"),
    ("early", "late"),
    ("rich", "poor"),
    ("strong", "weak"),
    ("thick", "thin"),
    ("loud", "quiet"),
    ("clean", "dirty"),
    ("good", "bad"),
    ("long", "short"),
    ("true", "false"),
    ("inside", "outside"),
    ("day", "night"),
    ("love", "hate"),
    ("first", "last"),
    ("top", "bottom"),
    ("left", "right"),
    ("near", "far"),
    ("high", "low"),
    ("wide", "narrow"),
    ("deep", "shallow"),
    ("cheap", "expensive"),
    ("asleep", "awake"),
    ("alive", "dead"),
    ("north", "south"),
    ("east", "west"),
    ("summer", "winter"),
    ("above", "below"),
    ("before", "after"),
    ("push", "pull"),
    ("win", "lose"),
    ("buy", "sell"),
    ("smooth", "rough"),
    ("safe", "dangerous"),
    ("laugh", "cry"),
    ("give", "take"),
    ("heavy", "light"),
    ("sweet", "sour"),
    ("friend", "enemy"),
    ("remember", "forget"),
    ("question", "answer"),
    ("start", "finish"),
    ("always", "never"),
]

_ANIMAL_SOUNDS = [  # with an article: bare "moo"/"meow" soak up the small model's probability
    ("a dog", "a bark"),
    ("a cat", "a meow"),
    ("a cow", "a moo"),
    ("a sheep", "a baa"),
    ("a duck", "a quack"),
    ("a pig", "an oink"),
    ("a horse", "a neigh"),
    ("a lion", "a roar"),
    ("an owl", "a hoot"),
    ("a snake", "a hiss"),
    ("a bee", "a buzz"),
    ("a frog", "a croak"),
    ("a mouse", "a squeak"),
    ("a wolf", "a howl"),
    ("a donkey", "a bray"),
]

_ANIMAL_CLASSES = [  # with an article, for the same reason (bare "fish" wins everything)
    ("a dog", "a mammal"),
    ("a whale", "a mammal"),
    ("a dolphin", "a mammal"),
    ("a bat", "a mammal"),
    ("a horse", "a mammal"),
    ("an elephant", "a mammal"),
    ("a lion", "a mammal"),
    ("a cow", "a mammal"),
    ("an eagle", "a bird"),
    ("a penguin", "a bird"),
    ("a parrot", "a bird"),
    ("a chicken", "a bird"),
    ("an ostrich", "a bird"),
    ("a pigeon", "a bird"),
    ("a shark", "a fish"),
    ("a salmon", "a fish"),
    ("a tuna", "a fish"),
    ("a goldfish", "a fish"),
    ("a trout", "a fish"),
    ("a snake", "a reptile"),
    ("a lizard", "a reptile"),
    ("a crocodile", "a reptile"),
    ("a turtle", "a reptile"),
    ("an ant", "an insect"),
    ("a bee", "an insect"),
    ("a butterfly", "an insect"),
    ("a beetle", "an insect"),
    ("a mosquito", "an insect"),
    ("a frog", "an amphibian"),
    ("a toad", "an amphibian"),
    ("a salamander", "an amphibian"),
]

_COLOURS = [
    ("grass", "green"),
    ("the sky on a clear day", "blue"),
    ("snow", "white"),
    ("coal", "black"),
    ("a ripe banana", "yellow"),
    ("blood", "red"),
    ("a carrot", "orange"),
    ("milk", "white"),
    ("a ripe tomato", "red"),
    ("a lemon", "yellow"),
    ("chocolate", "brown"),
    ("the night sky", "black"),
    ("a strawberry", "red"),
    ("a lime", "green"),
    ("a fire truck", "red"),
    ("an elephant", "grey"),
    ("a polar bear", "white"),
    ("a pumpkin", "orange"),
    ("a tree trunk", "brown"),
    ("a flamingo", "pink"),
    ("an eggplant", "purple"),
    ("a crow", "black"),
    ("a frog", "green"),
    ("the sea", "blue"),
]

_TOOLS = [
    ("cut paper", "scissors"),
    ("hit nails into wood", "a hammer"),
    ("turn screws", "a screwdriver"),
    ("dig a hole in the garden", "a shovel"),
    ("chop wood", "an axe"),
    ("sweep the floor", "a broom"),
    ("write on paper", "a pen"),
    ("see things that are very far away", "a telescope"),
    ("see things that are very small", "a microscope"),
    ("unlock a door", "a key"),
    ("sew clothes", "a needle"),
    ("brush your teeth", "a toothbrush"),
    ("comb your hair", "a comb"),
    ("boil water for tea", "a kettle"),
    ("take photographs", "a camera"),
    ("keep food cold", "a fridge"),
    ("stay dry in the rain", "an umbrella"),
    ("cut bread", "a knife"),
    ("eat soup", "a spoon"),
    ("find your way north", "a compass"),
    ("cut the grass", "a lawnmower"),
    ("light a candle", "a match"),
    ("stick paper together", "glue"),
    ("rub out pencil marks", "an eraser"),
    ("take the wrinkles out of clothes", "an iron"),
    ("cut a plank of wood", "a saw"),
]

_PLURALS = [
    ("child", "children"),
    ("mouse", "mice"),
    ("tooth", "teeth"),
    ("foot", "feet"),
    ("man", "men"),
    ("woman", "women"),
    ("goose", "geese"),
    ("person", "people"),
    ("knife", "knives"),
    ("leaf", "leaves"),
    ("wolf", "wolves"),
    ("box", "boxes"),
    ("baby", "babies"),
    ("city", "cities"),
    ("potato", "potatoes"),
    ("bus", "buses"),
    ("wife", "wives"),
    ("half", "halves"),
    ("story", "stories"),
    ("glass", "glasses"),
    ("life", "lives"),
    ("shelf", "shelves"),
    ("dish", "dishes"),
    ("church", "churches"),
    ("party", "parties"),
    ("lady", "ladies"),
    ("hero", "heroes"),
    ("loaf", "loaves"),
    ("calf", "calves"),
    ("thief", "thieves"),
]

_COUNTS = [
    ("How many legs does a spider have?", "8"),
    ("How many days are in a week?", "7"),
    ("How many months are in a year?", "12"),
    ("How many legs does a dog have?", "4"),
    ("How many wheels does a bicycle have?", "2"),
    ("How many sides does a triangle have?", "3"),
    ("How many sides does a square have?", "4"),
    ("How many sides does a hexagon have?", "6"),
    ("How many sides does an octagon have?", "8"),
    ("How many sides does a pentagon have?", "5"),
    ("How many hours are in a day?", "24"),
    ("How many minutes are in an hour?", "60"),
    ("How many seconds are in a minute?", "60"),
    ("How many legs does an insect have?", "6"),
    ("How many legs does a bird have?", "2"),
    ("How many wheels does a tricycle have?", "3"),
    ("How many fingers are on one hand?", "5"),
    ("How many eyes does a person have?", "2"),
    ("How many seasons are in a year?", "4"),
    ("How many wheels does a car have?", "4"),
]

_LANGUAGES = [
    ("France", "French"),
    ("Germany", "German"),
    ("Spain", "Spanish"),
    ("Italy", "Italian"),
    ("Japan", "Japanese"),
    ("China", "Chinese"),
    ("Russia", "Russian"),
    ("Portugal", "Portuguese"),
    ("Brazil", "Portuguese"),
    ("Mexico", "Spanish"),
    ("Greece", "Greek"),
    ("the Netherlands", "Dutch"),
    ("Sweden", "Swedish"),
    ("Poland", "Polish"),
    ("Turkey", "Turkish"),
    ("South Korea", "Korean"),
    ("Egypt", "Arabic"),
    ("England", "English"),
    ("Ukraine", "Ukrainian"),
    ("Finland", "Finnish"),
    ("Norway", "Norwegian"),
    ("Denmark", "Danish"),
    ("Hungary", "Hungarian"),
    ("Argentina", "Spanish"),
    ("Australia", "English"),
    ("Israel", "Hebrew"),
    ("Thailand", "Thai"),
    ("Vietnam", "Vietnamese"),
    ("Austria", "German"),
]

_JOBS = [
    ("treats sick people in a hospital", "a doctor"),
    ("teaches children at school", "a teacher"),
    ("flies an aeroplane", "a pilot"),
    ("puts out fires", "a firefighter"),
    ("bakes bread", "a baker"),
    ("grows crops on a farm", "a farmer"),
    ("fixes leaking pipes", "a plumber"),
    ("cooks food in a restaurant kitchen", "a chef"),
    ("looks after sick animals", "a vet"),
    ("checks and fixes your teeth", "a dentist"),
    ("catches criminals", "a police officer"),
    ("writes books", "an author"),
    ("serves food at tables in a restaurant", "a waiter"),
    ("cuts hair", "a hairdresser"),
    ("delivers letters", "a postman"),
    ("repairs cars", "a mechanic"),
    ("designs buildings", "an architect"),
    ("works in a library", "a librarian"),
    ("makes furniture from wood", "a carpenter"),
    ("acts in films", "an actor"),
    ("catches fish for a living", "a fisherman"),
    ("looks after patients in a hospital ward", "a nurse"),
]

_SCIENCE: list[Table] = [
    (
        [
            ("What do bees make?", "honey"),
            ("What do hens lay?", "eggs"),
            ("What do cows give us to drink?", "milk"),
            ("What is frozen water called?", "ice"),
            ("What do caterpillars turn into?", "butterflies"),
            ("What falls from clouds when it rains?", "water"),
            ("What do spiders spin?", "webs"),
            ("What gas do people need to breathe to stay alive?", "oxygen"),
        ],
        [],
    ),
    (
        [
            ("What does a thermometer measure?", "temperature"),
            ("What does a clock measure?", "time"),
            ("What does a ruler measure?", "length"),
            ("What does a weighing scale measure?", "weight"),
            ("What does a speedometer measure?", "speed"),
        ],
        [],
    ),
    (
        [
            ("Which planet do we live on?", "Earth"),
            ("Which planet is known as the Red Planet?", "Mars"),
            ("What is the largest planet in the solar system?", "Jupiter"),
            ("Which planet is famous for its rings?", "Saturn"),
            ("Which planet is closest to the Sun?", "Mercury"),
        ],
        ["Venus", "Neptune"],
    ),
    (
        [
            ("What is the star at the centre of our solar system called?", "the Sun"),
            ("What goes around the Earth about once a month?", "the Moon"),
        ],
        ["a comet", "the sky"],
    ),
    (
        [
            ("At what temperature in degrees Celsius does water freeze?", "0 degrees"),
            ("At what temperature in degrees Celsius does water boil?", "100 degrees"),
        ],
        ["50 degrees", "20 degrees", "75 degrees"],
    ),
    (
        [
            ("Which organ pumps blood around the body?", "the heart"),
            ("Which organ do we think with?", "the brain"),
            ("Which organs do we breathe with?", "the lungs"),
            ("Which organ digests food?", "the stomach"),
        ],
        ["the liver", "the kidneys"],
    ),
]

_BODY = [
    ("see", "eyes"),
    ("hear", "ears"),
    ("smell", "nose"),
    ("taste", "tongue"),
    ("chew food", "teeth"),
    ("walk", "legs"),
    ("hold a cup", "hands"),
    ("think", "brain"),
]

_WEAR = [
    ("a hat", "head"),
    ("shoes", "feet"),
    ("gloves", "hands"),
    ("a ring", "finger"),
    ("a watch", "wrist"),
    ("a scarf", "neck"),
    ("earrings", "ears"),
    ("glasses", "face"),
]


def _rows(pairs: list[tuple[str, str]], template: str) -> list[tuple[str, str]]:
    return [(template.format(x), a) for x, a in pairs]


CATEGORIES: dict[str, list[Table]] = {
    "capitals": [(_rows(_COUNTRIES_CAPITALS, "What is the capital of {}?"), [])],
    "opposites": [(_rows(_OPPOSITES, "What is the opposite of {}?"), [])],
    "animal_sounds": [(_rows(_ANIMAL_SOUNDS, "What sound does {} make?"), [])],
    "animal_classes": [(_rows(_ANIMAL_CLASSES, "What kind of animal is {}?"), [])],
    "colours": [(_rows(_COLOURS, "What colour is {}?"), [])],
    "tools": [(_rows(_TOOLS, "What do you use to {}?"), [])],
    "plurals": [(_rows(_PLURALS, "What is the plural of {}?"), [])],
    "counts": [(_COUNTS, [])],
    "languages": [(_rows(_LANGUAGES, "What language do most people speak in {}?"), [])],
    "jobs": [(_rows(_JOBS, "What do you call a person who {}?"), [])],
    "science": _SCIENCE,
    "body": [
        (_rows(_BODY, "Which part of the body do you use to {}?"), []),
        (_rows(_WEAR, "On which part of the body do you wear {}?"), []),
    ],
}


def _related(a: str, b: str) -> bool:
    a, b = a.lower(), b.lower()
    return a.startswith(b) or b.startswith(a)


def _entries() -> dict[str, list[tuple[str, str, list[str]]]]:
    """Per category: (question, answer, distractor pool) rows, each question once."""
    out: dict[str, list[tuple[str, str, list[str]]]] = {}
    seen: set[str] = set()
    for name, tables in CATEGORIES.items():
        rows = []
        for pairs, extra in tables:
            pool = list(dict.fromkeys([a for _, a in pairs] + extra))
            for question, answer in pairs:
                if question in seen:
                    raise ValueError(f"duplicate general question: {question!r}")
                seen.add(question)
                rows.append((question, answer, pool))
        out[name] = rows
    return out


def _item(rng: random.Random, question: str, answer: str, pool: list[str]) -> Item:
    candidates = [c for c in pool if not _related(c, answer)]
    rng.shuffle(candidates)
    distractors: list[str] = []
    for c in candidates:
        if not any(_related(c, d) for d in distractors):
            distractors.append(c)
            if len(distractors) == N_CHOICES - 1:
                break
    if len(distractors) < N_CHOICES - 1:
        raise ValueError(f"not enough distractors for {question!r}")
    choices = [answer, *distractors]
    rng.shuffle(choices)
    return {"question": question, "choices": choices, "answer": choices.index(answer)}


def tagged_general_items(seed: int, n: int) -> list[tuple[str, Item]]:
    """Like :func:`general_items`, but each item comes with its category name."""
    entries = _entries()
    total = sum(len(rows) for rows in entries.values())
    if not 0 <= n <= total:
        raise ValueError(f"n must be between 0 and {total} distinct general items, got {n}")
    rng = random.Random(f"general-{seed}")
    names = sorted(entries)
    rng.shuffle(names)  # which categories get the remainder depends on the seed
    queues = {}
    for name in names:
        rows = list(entries[name])
        rng.shuffle(rows)
        queues[name] = rows
    picked: list[tuple[str, tuple[str, str, list[str]]]] = []
    while len(picked) < n:  # round-robin over categories that still have rows
        for name in names:
            if queues[name] and len(picked) < n:
                picked.append((name, queues[name].pop()))
    return [(name, _item(rng, q, a, pool)) for name, (q, a, pool) in picked]


def general_items(seed: int, n: int) -> list[Item]:
    """n distinct items, deterministic in seed, drawn across categories (balanced)."""
    return [item for _, item in tagged_general_items(seed, n)]
