"""How results look: one palette (style), the Compare cards, plotly figures, tables, the Inside and
Trade-offs figures, the benchmark page and the HTML report. Reads results; runs nothing.
"""
